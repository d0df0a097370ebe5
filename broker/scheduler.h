// The continuous-batching scheduler: one thread that owns the worker connection and every
// sequence. Each step packs the decode tokens of running sequences with prefill chunks of new
// ones under a token budget, admits first come first served by free KV blocks, preempts by
// recompute when blocks run out, samples from verified rows and streams tokens out.
//
// A sequence is its full token history plus how much of it the worker's KV cache holds. Prefill,
// decode, recompute after preemption and replay onto a new worker are all the same operation:
// feed the tokens the cache lacks, sample when the last one is fed.
//
// Supervision lives here too, because the scheduler is the one that talks to the worker: a
// worker that exits, hangs, breaks the protocol or keeps failing verification is replaced and its
// sequences replayed; a new worker must pass the canary before it takes traffic; tokens are held
// back until the worker's scrubber vouches for the weights that produced them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "broker/canary.h"
#include "broker/kv_allocator.h"
#include "broker/sampler.h"
#include "broker/sequence.h"
#include "broker/worker_client.h"

namespace bulkhead {

struct SchedulerOptions {
  uint32_t max_batch_tokens = 512;  // tokens per step (further capped by the worker)
  uint32_t max_running = 64;
  uint32_t max_waiting = 1024;  // beyond this, RESOURCE_EXHAUSTED
  // A step's deadline: base + per_token * tokens in the step.
  std::chrono::milliseconds step_timeout_base{10'000};
  std::chrono::microseconds step_timeout_per_token{10'000};
  uint32_t integrity_retries = 2;  // retries of a step whose rows failed before a restart
  // Crash loop: after this many failures in a row (failed starts, or workers that fail before
  // completing a step) the worker is marked failed and waiting requests get UNAVAILABLE.
  uint32_t max_consecutive_failures = 5;
  std::chrono::milliseconds restart_backoff_initial{50};
  std::chrono::milliseconds restart_backoff_max{5'000};
  // Canary between generations, when idle for this long since the last one (0: only at start).
  std::chrono::milliseconds canary_interval{60'000};
  // An idle worker is sent a heartbeat this often, so a hang is noticed without traffic.
  std::chrono::milliseconds heartbeat_interval{2'000};
  std::filesystem::path state_dir;  // canary records; empty: kept in memory only
};

struct SchedulerStats {
  uint64_t requests_received = 0, requests_completed = 0, requests_failed = 0,
           requests_rejected = 0;
  uint32_t requests_running = 0, requests_waiting = 0;
  uint64_t tokens_generated = 0, steps = 0, preemptions = 0, worker_restarts = 0,
           replayed_sequences = 0, integrity_failures = 0, weight_corruptions = 0, canary_runs = 0,
           canary_failures = 0;
};

struct WorkerStatus {
  std::string state = "starting";  // starting | ready | failed | stopped
  uint64_t incarnation = 0;
  int pid = 0;
  std::string backend;
  uint32_t kv_blocks_total = 0, kv_blocks_free = 0;
  uint32_t restarts = 0;
  std::string last_failure;
};

// Fault classes an operator (or `bulkhead chaos`) can inject through the broker.
enum class ChaosFault {
  kWorkerKill,
  kWorkerHang,
  kWeightBitflip,
  kLogitsCorrupt,
  kLogitsNan,
  kTornWrite,
  kStaleEpoch,
  kSlowStep,
};

struct InjectionOutcome {
  bool detected = false, recovered = false;
  double detection_ms = 0, recovery_ms = 0;
  std::string detected_as;
};

// Starts a worker incarnation.
using WorkerFactory =
    std::function<WorkerResult<std::unique_ptr<WorkerClient>>(uint64_t incarnation)>;

struct ModelLimits {
  uint32_t vocab_size = 0;
  uint32_t max_context = 0;
  std::vector<uint32_t> eos_token_ids;
};

class Scheduler {
 public:
  Scheduler(WorkerFactory factory, ModelLimits model, SchedulerOptions options);
  ~Scheduler();

  // Starts the scheduling thread (which starts the worker).
  void start();
  void stop();

  // Queues a validated request. RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE while
  // draining or when the worker has failed.
  Status submit(GenerationRequest request, std::shared_ptr<TokenSink> sink);

  // Called with true when a worker is ready to serve and false when none is.
  void setServingCallback(std::function<void(bool)> callback);
  // Stops admitting and waits (up to `timeout`) until nothing runs; returns requests finished.
  Result<uint32_t> drain(std::chrono::milliseconds timeout);
  // Replaces the worker; in-flight sequences are replayed. Returns {old, new} incarnations.
  Result<std::pair<uint64_t, uint64_t>> restartWorker(std::chrono::milliseconds timeout);
  // Injects one fault (the worker must run with fault injection) and waits until it is detected
  // and service has recovered, or `timeout`. `random` picks rows, bits and offsets.
  Result<InjectionOutcome> injectFault(ChaosFault fault, uint64_t random,
                                       std::chrono::milliseconds timeout);

  SchedulerStats stats() const;
  WorkerStatus workerStatus() const;

 private:
  struct Sequence;
  void run();
  void notify();
  void waitForWork(std::chrono::steady_clock::time_point until);
  bool ensureWorker();
  bool passesCanary();
  void replaceWorker(const std::string& why);
  void recordFailure(const std::string& what);
  void recordSuccess();
  void admit();
  bool stepOnce();
  void applyScrub(const ScrubStatus& scrub);
  void rollBack(uint64_t from_step);
  void release(uint64_t clean_through);
  void finish(Sequence& seq, FinishReason reason, const Status& status);
  void preemptLast();
  void requeueAll();
  FinishReason stopReason(const Sequence& seq) const;
  void failAll(const Status& status);
  void applyInjection();
  uint32_t blocksFor(uint64_t positions) const;
  bool growBlocks(Sequence& seq, uint64_t positions);
  void freeBlocks(Sequence& seq);
  void setServing(bool serving);
  bool hasUnreleased() const;

  const WorkerFactory factory_;
  const ModelLimits model_;
  const SchedulerOptions options_;
  CanaryStore canaries_;

  // Shared with RPC threads.
  mutable std::mutex mu_;
  std::condition_variable idle_;  // drains, restarts and injections wait on it
  std::deque<std::unique_ptr<Sequence>> incoming_;
  bool stopping_ = false;
  bool draining_ = false;
  bool restart_requested_ = false;
  std::pair<uint64_t, uint64_t> last_restart_{0, 0};
  SchedulerStats stats_;
  WorkerStatus worker_status_;
  std::function<void(bool)> serving_callback_;
  bool serving_ = false;
  uint32_t finished_while_draining_ = 0;
  struct Injection {
    ChaosFault fault;
    uint64_t random;
    bool applied = false;
    std::chrono::steady_clock::time_point at, detected_at, recovered_at;
    std::string detected_as;
  };
  std::shared_ptr<Injection> injection_;

  // Scheduler thread only.
  int wake_fd_ = -1;
  std::thread thread_;
  std::unique_ptr<WorkerClient> worker_;
  uint64_t next_incarnation_ = 1;
  uint64_t next_sequence_id_ = 1;
  uint64_t next_step_id_ = 1;
  uint32_t consecutive_failures_ = 0;
  bool worker_proven_ = false;  // the current worker completed a step
  std::chrono::steady_clock::time_point next_start_at_{};
  std::chrono::steady_clock::time_point last_canary_{};
  std::chrono::steady_clock::time_point last_contact_{};  // last reply from the worker
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::vector<std::unique_ptr<Sequence>> finishing_;  // stopped, tokens not all released yet
  KvBlockAllocator blocks_;
  Sampler sampler_;
  uint32_t step_failures_in_a_row_ = 0;
};

}  // namespace bulkhead
