// StepRunner: one Step message from decoding to StepDone. Copies the message's lists out (sizes
// checked first), runs the step on the backend straight into the arena's slots, publishes each
// row under the checksum its producer computed, and reports what the weight scrubber vouches for.
#pragma once

#include <chrono>
#include <cstdint>
#include <shared_mutex>
#include <vector>

#include "proto/worker.capnp.h"
#include "shared/logits_arena.h"
#include "worker/backend.h"
#include "worker/fault_hooks.h"
#include "worker/weight_scrubber.h"

namespace bulkhead {

// A scrub report onto the wire.
void fillScrubReport(wire::ScrubReport::Builder out, const ScrubReport& report);

enum class StepVerdict {
  kDone,      // StepDone written
  kRejected,  // bad input, nothing changed: answer Error and keep serving
  kFatal,     // the backend failed: the worker must exit
};

struct StepOutcome {
  StepVerdict verdict = StepVerdict::kDone;
  Status status;  // why, unless kDone
  ReplyForm form = ReplyForm::kMessage;
};

class StepRunner {
 public:
  // `weights_mutex` is held shared from enqueue to wait, so repairs and bit flips wait.
  StepRunner(Backend& backend, LogitsArena& arena, WeightScrubber& scrubber,
             std::shared_mutex& weights_mutex, StepFaults& faults);

  // Runs `step`; on kDone, `reply` holds its StepDone.
  StepOutcome run(wire::Step::Reader step, wire::FromWorker::Builder reply);

 private:
  // Copies the sequences' lists out of the message into batch_; counts requested rows.
  Status decode(wire::Step::Reader step, uint32_t& total_rows);
  using Clock = std::chrono::steady_clock;
  // enqueueStep + waitStep into the arena slots (or where a fault diverts a row); `from` and `to`
  // say when the compute began and ended.
  StepOutcome compute(uint32_t total_rows, uint64_t step_id, Clock::time_point& from,
                      Clock::time_point& to);
  // Publishes every row's header and lists it in StepDone.
  void publish(uint64_t step_id, wire::StepDone::Builder done);

  Backend& backend_;
  LogitsArena& arena_;
  WeightScrubber& scrubber_;
  std::shared_mutex& weights_mutex_;
  StepFaults& faults_;
  // Reused across steps: no allocation per step once warm.
  std::vector<uint32_t> lists_;
  std::vector<SequenceStep> batch_;
  std::vector<float*> slots_;  // the arena slot of each requested row
  uint32_t first_slot_ = 0;    // the step's rows go to slots first_slot_ onwards
  std::vector<RowOutput> rows_;
  std::vector<RowCheck> checks_;
  WeightReadVerdict verdict_;  // the last step's in-step weight check
};

}  // namespace bulkhead
