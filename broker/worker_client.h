// The broker's handle on one worker incarnation: spawns (or connects to) bulkhead-worker, sends
// steps, and returns logits rows that passed every integrity check, as zero-copy views into the
// arena. Every failure comes back typed, so the supervisor can decide what to do with it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "shared/child_process.h"
#include "shared/ipc_frame.h"
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

template <typename T>
using WorkerResult = Result<T, WorkerFailure>;

struct WorkerHello {
  int pid = 0;
  uint64_t incarnation = 0;
  std::string backend, architecture, model_dir;
  uint32_t vocab_size = 0, max_context = 0, kv_block_size = 0, kv_block_count = 0;
  uint32_t max_step_tokens = 0, arena_slots = 0;
  uint64_t weight_bytes = 0, weight_digest = 0;
  bool fault_injection = false;
  std::vector<uint32_t> eos_token_ids;
  uint64_t model_identity = 0;
  bool scrubbing = false;
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

enum class FaultKind {
  kCrash,
  kHang,
  kCorruptPayload,
  kTornWrite,
  kStaleIncarnation,
  kStaleStep,
  kNanRow,
  kGarbageReply,
  kTruncatedReply,
  kSlowStep,
  kWeightBitflip,
};

struct FaultSpec {
  FaultKind kind = FaultKind::kCrash;
  uint32_t row = 0;          // which requested row of the next step (row faults)
  uint32_t delay_ms = 0;     // kSlowStep
  uint64_t byte_offset = 0;  // kWeightBitflip
  uint8_t bit = 0;           // kWeightBitflip
};

struct StepRows {
  // One verified row per requested logits row, in request order. Valid until the next call.
  std::vector<std::span<const float>> rows;
  uint64_t compute_micros = 0;  // as reported by the worker
  ScrubStatus scrub;
};

class WorkerClient {
 public:
  struct SpawnOptions {
    std::string worker_path;  // the bulkhead-worker executable
    std::string model_dir;
    std::string backend = "auto";
    std::string socket_dir;  // a private directory for the socket; created if absent
    uint64_t incarnation = 0;
    uint32_t kv_blocks = 0;
    uint32_t arena_slots = 64;
    bool enable_fault_injection = false;
    std::vector<std::string> extra_args;
    std::chrono::milliseconds start_timeout{120'000};
  };

  static WorkerResult<std::unique_ptr<WorkerClient>> spawn(const SpawnOptions& options);
  // Connects to a worker someone else runs (systemd). Its exit cannot be observed directly.
  static WorkerResult<std::unique_ptr<WorkerClient>> connect(const std::string& socket_path,
                                                             std::chrono::milliseconds timeout);
  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  const WorkerHello& hello() const { return hello_; }
  pid_t pid() const { return child_.pid(); }
  // Readable once a spawned worker has exited (-1 when connected to one we did not spawn).
  int exitFd() const { return child_.exitFd(); }
  // After any failure other than kRejected or kIntegrityFailure the connection is unusable;
  // further calls fail fast.
  bool broken() const { return !broken_by_.ok(); }

  WorkerResult<StepRows> step(uint64_t step_id, std::span<const SequenceStep> batch,
                              std::chrono::milliseconds timeout);
  // A round trip that also completes a full scrub pass on the worker.
  WorkerResult<ScrubStatus> ping(std::chrono::milliseconds timeout);
  WorkerFailure release(std::span<const uint64_t> sequence_ids, std::chrono::milliseconds timeout);
  // A cheap liveness check for an idle worker.
  WorkerFailure heartbeat(std::chrono::milliseconds timeout);
  WorkerFailure injectFault(const FaultSpec& fault, std::chrono::milliseconds timeout);
  // Asks the worker to exit cleanly and, for a spawned worker, reaps it.
  WorkerFailure shutdown(std::chrono::milliseconds timeout);
  // Sends a signal to a spawned worker (supervision and fault tests).
  void kill(int signal);
  // Raw bytes onto the socket, bypassing framing (protocol fault tests).
  Status sendRaw(const void* bytes, size_t size);

 private:
  WorkerClient() = default;
  // Sends `request` and reads one reply frame into reply_words_; the caller parses it.
  WorkerFailure roundTrip(capnp::MessageBuilder& request, SteadyTime deadline);
  // Marks the connection broken by `failure` and returns it.
  WorkerFailure fail(WorkerFailure failure);
  // Why the connection ended: the exit status if the process is gone by `wait_until`.
  WorkerFailure connectionLost(const std::string& what, SteadyTime wait_until);
  WorkerFailure handshake(SteadyTime deadline);
  void takeCarried(ScrubStatus& status);
  // A request carrying no payload (ping, shutdown, release, fault) answered by `expected`.
  WorkerFailure simpleCall(capnp::MessageBuilder& request, int expected_which,
                           std::chrono::milliseconds timeout);

  int fd_ = -1;
  ChildProcess child_;  // empty when connected to a worker someone else runs
  std::string owned_socket_dir_;
  WorkerHello hello_;
  std::unique_ptr<LogitsArena> arena_;
  uint64_t next_request_id_ = 1;
  WorkerFailure broken_by_;
  std::vector<capnp::word> reply_words_;
  // Corruption reports that arrived with a reply whose rows failed verification.
  std::vector<WeightCorruptionReport> carried_corruptions_;
};

}  // namespace bulkhead
