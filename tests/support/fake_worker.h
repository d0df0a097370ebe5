// An in-process WorkerConnection for scheduler tests. It keeps a real paged "KV cache" of token
// ids, and a row's logits are a fixed function of every token the block table maps at positions
// 0..p, so a sequence replayed with a wrong history, position or block table gets other logits.
// A shared FakeWorkerControl scripts faults and records every step, so tests can assert that
// sequences were in fact replayed on a new incarnation.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "broker/canary.h"
#include "broker/worker_connection.h"
#include "broker/worker_slot.h"

namespace bulkhead::test {

// The logits of the row that follows `history` (its last token at position history.size() - 1).
std::vector<float> fakeLogits(std::span<const uint32_t> history, uint32_t vocab);

// The reference engine for the fake's model: fakeLogits of each requested row's history.
CanaryReference fakeReference();

struct FakeStepRecord {
  uint64_t incarnation = 0, step_id = 0;
  uint64_t sequence_id = 0;
  uint32_t start_position = 0;
  std::vector<uint32_t> tokens;
};

struct FakeFault {
  enum class Kind {
    kFailStep,          // the step fails with `failure` (kExited breaks the connection)
    kCorruptRow,        // the first row's payload no longer matches its checksum
    kReportCorruption,  // the scrub report names a corrupted tensor, suspect from a past step
    // From this step on, this incarnation computes every row wrongly (as from another history),
    // with checksums that match: only the canary can tell.
    kMiscompute,
  };
  Kind kind = Kind::kFailStep;
  WorkerFailure::Kind failure = WorkerFailure::Kind::kExited;
  uint64_t suspect_steps_back = 0;  // kReportCorruption: suspect from (this step - n)
};

class FakeWorkerControl {
 public:
  uint32_t vocab = 64, block_size = 4, blocks = 256, max_step_tokens = 64, arena_slots = 64;
  std::string backend = "fake";  // what Hello says the worker computes on
  // The compute time a step of this many logits rows reports (the fake computes at once);
  // unset: 0. Set before the scheduler starts.
  std::function<uint64_t(size_t rows)> compute_micros;
  // What Hello says of the worker's compute (a CPU worker's grows with its rows), and the wall
  // time a step of this many logits rows takes: its reply is ready that long after the worker is
  // free for it (steps one after another, in order, as a worker computes them), and awaiting it
  // waits until then. Unset: ready at once. Set before the scheduler starts.
  bool compute_grows_with_rows = false;
  std::function<std::chrono::microseconds(size_t rows)> compute_wall;
  // StepDone vouches for steps up to (this step - lag); 0: every step at once.
  uint64_t scrub_lag = 0;
  // The worker says it checks every step's weight reads: its tokens need no scrubber's word, and
  // the broker may send it two steps at once.
  bool in_step_checks = false;
  // Every start after the first takes this long (a worker loading a large model).
  std::chrono::milliseconds restart_delay{0};
  // When valid, every start after the first also waits (at most 30 s) until it is ready: a restart
  // that lasts exactly until the test lets it end. Set before the scheduler starts.
  std::shared_future<void> restart_gate;
  // Called on the scheduler's thread as each step is sent, before it is computed (a test's hook
  // into the middle of a generation). Set before the scheduler starts.
  std::function<void(std::span<const SequenceStep> batch)> on_step;
  // Called on the scheduler's thread as start number `start` (from 1) begins, before it fails
  // or succeeds. Set before the scheduler starts.
  std::function<void(uint32_t start)> on_start;

  // The fault fires on the `after_steps`-th step from now that carries logits rows.
  void scheduleFault(uint32_t after_steps, FakeFault fault);
  // The next `count` starts fail.
  void failStarts(uint32_t count);
  // The next `count` incarnations compute every row wrongly from their first step.
  void miscomputeFromBirth(uint32_t count);

  std::vector<FakeStepRecord> steps() const;
  // The most steps that were ever sent and not yet awaited at once.
  size_t maxInFlight() const;
  // Scripted faults that fired in a step sent while another step awaited its reply.
  size_t faultsBesideAStepInFlight() const;
  uint32_t starts() const;
  // A factory for Scheduler / WorkerSlot.
  WorkerFactory factory(std::shared_ptr<FakeWorkerControl> self);

 private:
  friend class FakeWorker;
  mutable std::mutex mu_;
  std::vector<FakeStepRecord> steps_;
  std::deque<std::pair<uint32_t, FakeFault>> faults_;
  uint32_t failing_starts_ = 0;
  uint32_t miscomputing_starts_ = 0;
  uint32_t starts_ = 0;
  size_t max_in_flight_ = 0;
  size_t faults_beside_a_step_in_flight_ = 0;
};

class FakeWorker final : public WorkerConnection {
 public:
  FakeWorker(std::shared_ptr<FakeWorkerControl> control, uint64_t incarnation);

  const WorkerHello& hello() const override { return hello_; }
  int exitFd() const override { return -1; }
  // The fake computes a step when it is sent (in order, as the worker does) and hands its reply
  // over when it is awaited; the rows of the last few steps stay alive meanwhile.
  WorkerFailure sendStep(uint64_t step_id, std::span<const SequenceStep> batch, uint32_t first_slot,
                         std::chrono::milliseconds timeout) override;
  WorkerResult<StepReply> awaitStep() override;
  WorkerResult<ScrubStatus> ping(std::chrono::milliseconds timeout) override;
  WorkerFailure heartbeat(std::chrono::milliseconds timeout) override;
  WorkerFailure injectFault(const FaultSpec& fault, std::chrono::milliseconds timeout) override;
  WorkerFailure shutdown(std::chrono::milliseconds timeout) override;

 private:
  std::optional<FakeFault> takeFault();
  WorkerResult<StepReply> compute(uint64_t step_id, std::span<const SequenceStep> batch,
                                  std::vector<std::vector<float>>& rows);
  std::shared_ptr<FakeWorkerControl> control_;
  WorkerHello hello_;
  std::vector<uint32_t> kv_;  // [block][slot] token ids
  // Replies sent but not awaited, and each step's rows (the newest kMaxStepsInFlight + 1 kept).
  std::deque<WorkerResult<StepReply>> replies_;
  std::deque<std::vector<std::vector<float>>> rows_;
  std::deque<std::chrono::steady_clock::time_point> ready_;  // with replies_ (compute_wall)
  std::chrono::steady_clock::time_point free_at_{};          // the last step's ready time
  uint64_t last_step_ = 0;
  WorkerFailure broken_;
  bool miscompute_ = false;
};

}  // namespace bulkhead::test
