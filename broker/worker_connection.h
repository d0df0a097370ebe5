// What the scheduler needs from a worker incarnation, as an interface: WorkerClient speaks to a
// real bulkhead-worker process; tests/support/fake_worker.h is an in-process fake, so scheduling,
// release, rollback and replay can be tested without processes. Every failure comes back typed.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/fault.h"
#include "shared/logits_arena.h"
#include "shared/status.h"
#include "shared/step_types.h"

namespace bulkhead {

struct WorkerFailure {
  enum class Kind {
    kNone,
    kExited,             // the process is gone: exit_code or signal says how
    kTimedOut,           // no reply by the deadline (the process may be hung)
    kProtocolViolation,  // unparseable, out-of-order or inconsistent replies
    kIntegrityFailure,   // a logits row failed `check`
    kRejected,           // the worker refused the request: `code` and message say why
    kStartFailed,        // could not spawn or connect
  };
  Kind kind = Kind::kNone;
  std::string message;
  int exit_code = -1;  // kExited: exit status when it exited normally
  int signal = 0;      // kExited: the signal that killed it
  IntegrityCheck check = IntegrityCheck::kNone;
  Code code = Code::kOk;  // kRejected: the worker's status code

  bool ok() const { return kind == Kind::kNone; }
  // The canonical status a client would see for this failure.
  Status toStatus() const;
  std::string toString() const;
};
std::string_view workerFailureKindName(WorkerFailure::Kind kind);
WorkerFailure workerFailure(WorkerFailure::Kind kind, std::string message);

template <typename T>
using WorkerResult = Result<T, WorkerFailure>;

// Steps a broker may have sent whose replies it has not read.
constexpr size_t kMaxStepsInFlight = 2;

struct WorkerHello {
  int pid = 0;
  uint64_t incarnation = 0;
  std::string backend, architecture, model_dir;
  uint32_t vocab_size = 0, max_context = 0, kv_block_size = 0, kv_block_count = 0;
  uint32_t max_step_tokens = 0, arena_slots = 0;
  uint64_t weight_bytes = 0, weight_digest = 0;  // every weight, resident or streamed
  uint64_t streamed_weight_bytes = 0;            // of weight_bytes, copied in every step
  bool fault_injection = false;
  std::vector<uint32_t> eos_token_ids;
  uint64_t model_identity = 0;
  bool scrubbing = false;
  bool in_step_checks = false;           // every step checks the weight words it read
  bool compute_grows_with_rows = false;  // a CPU: half steps cost half (see the scheduler)
};

struct WeightCorruptionReport {
  std::string tensor;
  uint64_t offset = 0, bytes = 0;
  uint64_t suspect_from_step = 0;
};

// What the worker's weight scrubber vouches for (see worker/weight_scrubber.h).
struct ScrubStatus {
  uint64_t clean_through = 0;  // steps up to this id computed with verified weights
  std::vector<WeightCorruptionReport> corruptions;  // found and repaired since the last report
};

// A logits row whose header matched what was asked for. Its payload is not verified yet: the
// broker's sampling pool checks the checksum and finiteness in the same pass that samples it
// (broker/sampler.h), so each row is read from shared memory once.
struct PendingRow {
  std::span<const float> payload;
  uint64_t checksum = 0;  // the header's, equal to the one StepDone reported
};

// Where a step's time went, in nanoseconds of the host's monotonic clock (monotonicNanos): the
// broker's own two times, and the worker's as it reports them (for measurement only; 0 where a
// worker did not say).
struct StepTimeline {
  int64_t sent = 0;  // the broker began writing the step
  int64_t arrived = 0, compute_start = 0, compute_end = 0, replying = 0;  // the worker's
  int64_t read = 0;  // the broker had read the reply
};

struct StepReply {
  // One per requested logits row, in request order (see WorkerConnection::awaitStep for how long
  // they stay valid).
  std::vector<PendingRow> rows;
  uint64_t compute_micros = 0;  // as reported by the worker
  ScrubStatus scrub;
  StepTimeline timeline;
};

class WorkerConnection {
 public:
  virtual ~WorkerConnection() = default;

  virtual const WorkerHello& hello() const = 0;
  // Readable once the worker process has exited; -1 when that cannot be observed.
  virtual int exitFd() const = 0;

  // Sends a step without waiting for its reply; awaitStep() takes the replies in the order the
  // steps were sent. At most kMaxStepsInFlight steps await their replies at once, each with its
  // own arena slots (its rows go to slots first_slot onwards), so one step's rows stay intact while
  // the broker reads them and the next step computes. The worker computes steps one after
  // another, so a step's `timeout` runs from the end of the one before it. Nothing but steps may
  // be sent while a step awaits its reply.
  virtual WorkerFailure sendStep(uint64_t step_id, std::span<const SequenceStep> batch,
                                 uint32_t first_slot, std::chrono::milliseconds timeout) = 0;
  // The reply to the oldest step sent. Its rows stay valid until the step after the next is sent.
  // Rows failing a header check come back as kIntegrityFailure; the connection stays usable after
  // kRejected and kIntegrityFailure, and is broken after anything else.
  virtual WorkerResult<StepReply> awaitStep() = 0;
  // One step alone, its rows from slot 0.
  WorkerResult<StepReply> step(uint64_t step_id, std::span<const SequenceStep> batch,
                               std::chrono::milliseconds timeout) {
    if (WorkerFailure f = sendStep(step_id, batch, 0, timeout); !f.ok()) return f;
    return awaitStep();
  }
  // A round trip that also completes a full scrub pass on the worker.
  virtual WorkerResult<ScrubStatus> ping(std::chrono::milliseconds timeout) = 0;
  // A cheap liveness check for an idle worker.
  virtual WorkerFailure heartbeat(std::chrono::milliseconds timeout) = 0;
  virtual WorkerFailure injectFault(const FaultSpec& fault, std::chrono::milliseconds timeout) = 0;
  // Asks the worker to exit cleanly (and reaps it when it is a child).
  virtual WorkerFailure shutdown(std::chrono::milliseconds timeout) = 0;
};

}  // namespace bulkhead
