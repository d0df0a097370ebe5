// The continuous-batching scheduler: one thread that owns every sequence and drives the worker
// slot. Each step packs the decode tokens of running sequences with prefill chunks of new ones
// (broker/batch_planner.h), verifies and samples the rows on the sampling pool, and releases
// tokens to their streams once the worker vouches for the steps that produced them
// (broker/release_ledger.h).
//
// A sequence is its full token history plus how much of it the worker's KV cache holds. Prefill,
// decode, recompute after preemption and replay onto a new worker are all the same operation:
// feed the tokens the cache lacks, sample when the last one is fed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "broker/batch_planner.h"
#include "broker/broker_stats.h"
#include "broker/canary.h"
#include "broker/fault_injection.h"
#include "broker/row_sampling.h"
#include "broker/sequence_queues.h"
#include "broker/step_costs.h"
#include "broker/worker_slot.h"
#include "shared/work_pool.h"

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
  // The canary's continuation rides along with every N-th client step (0: never).
  uint32_t canary_every_steps = 16;
  // Qualifies a canary that no record vouches for (the CPU reference engine, in-process).
  CanaryReference canary_reference;
  // A record an operator pinned (`bulkhead qualify`): the only reference, nothing is recorded.
  std::optional<CanaryRecord> pinned_canary;
  // A sequence that stopped waits at most about this long before the broker asks the worker for a
  // full scrub pass to vouch for its last tokens (instead of waiting for the background pass).
  std::chrono::milliseconds finish_vouch_interval{10};
  // Two steps go to the worker at once, each for about half the running sequences, once verifying
  // and sampling a step's rows takes at least this share of the worker's compute time (and again
  // one at a time below half of it). Halving a GPU batch costs compute (the weights are read once
  // a step, whatever its rows): on the H200 two 32-row 0.5B steps took 25% longer than one of 64,
  // so below ~40% the halves lose more than the overlap wins. Once decode steps of the whole and
  // the half size have been seen, their measured costs decide instead (StepCosts). Beside a worker
  // whose compute grows with its rows (the CPU, whose cores the sampling shares) neither decides:
  // each mode is run in turn and its realised pace measured, and the faster is kept
  // (StepCosts::fasterPace). Negative: always one at a time; 0: always two.
  double pipeline_sample_share = 0.4;
  // Beside a CPU worker (which leaves WorkPool::coresBesideCpuWorker of the host's cores), rows
  // sampled while the worker computes another step are sampled on this many threads only, so
  // sampling takes no cores from the worker's step (WorkPool::setParticipants); while the worker
  // waits, every thread samples. 0: the pool as it was made.
  unsigned cpu_worker_sampling_threads = 0;
  // The threads of the pool that spin while it is kept warm, beside a CPU worker and beside any
  // other (the rest sleep between bursts and are woken for one). 0: all of them.
  unsigned cpu_worker_warm_spinners = 0, warm_spinners = 0;
  // An idle worker is sent a heartbeat this often, so a hang is noticed without traffic.
  std::chrono::milliseconds heartbeat_interval{2'000};
  std::filesystem::path state_dir;  // canary records; empty: kept in memory only
  // Called by the scheduling thread on every pass of its loop (at least once a second; the worker
  // factory calls it too while it waits): the broker's watchdog ping, from the loop that must be
  // alive, not a side thread.
  std::function<void()> alive;
};

struct ModelLimits {
  uint32_t vocab_size = 0;
  uint32_t max_context = 0;
  std::vector<uint32_t> eos_token_ids;
};

// What the schedulers of one broker share, one scheduler per worker (broker/router.h). The
// defaults make a scheduler that stands alone.
struct SchedulerLinks {
  std::string worker_name = "worker-0";
  std::shared_ptr<CanaryStore> canaries;  // null: the scheduler's own
  // Sequence ids, unique across the workers (a sequence keeps its id when it moves); null: the
  // scheduler's own counter.
  std::shared_ptr<std::atomic<uint64_t>> sequence_ids;
  // Offers sequences this scheduler cannot compute now (its worker was lost, is starting or is
  // drained; they hold no KV blocks) to the other workers, which take them from `sequences`; those
  // left there stay. With no other worker ready and `may_park`, they wait in the router for the
  // first worker that is (while any can still become ready). Returns how many went to another
  // worker. Called on this scheduler's thread without its lock; null: they all stay.
  std::function<size_t(std::vector<SequencePtr>& sequences, bool may_park)> hand_off;
  // Appends the sequences parked in the router (this scheduler's worker is ready).
  std::function<void(std::vector<SequencePtr>& into)> claim_parked;
  // This worker entered a crash loop or was drained: parked sequences fail with `status` if no
  // worker can serve them any more.
  std::function<void(const Status& status)> stopped_serving;
  // Whether any worker may still serve (one not drained and not in a crash loop); null: this one.
  std::function<bool()> any_alive;
  // When this worker is lost holding no sequence, `done` runs after the next step another ready
  // worker completes: service went on without a pause (the fault injector's recovery).
  std::function<void(std::function<void()> done)> served_elsewhere;
};

class Scheduler {
 public:
  // `pool` verifies and samples logits rows; it may be shared with other schedulers.
  Scheduler(WorkerFactory factory, ModelLimits model, SchedulerOptions options, WorkPool& pool,
            SchedulerLinks links = {});
  ~Scheduler();

  // Starts the scheduling thread (which starts the worker).
  void start();
  // Asks the scheduling thread to stop: it starts no worker from now on (one lost now is not
  // replaced) and ends every open request. stop() also waits for it.
  void requestStop();
  void stop();

  // Queues a validated request. RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE while
  // draining or when the worker has failed.
  Status submit(GenerationRequest request, std::shared_ptr<TokenSink> sink);

  // Called with true when a worker is ready to serve and false when none is.
  void setServingCallback(std::function<void(bool)> callback);
  // Stops admitting and waits (up to `timeout`) until nothing runs; returns requests finished.
  Result<uint32_t> drain(std::chrono::milliseconds timeout);
  // drain() in two halves, so that several schedulers stop admitting at the same moment.
  void beginDrain();
  Result<uint32_t> awaitDrained(std::chrono::steady_clock::time_point deadline);

  // Sequences that move here from another worker (their history is replayed here), taken only
  // while this worker serves: false, with `sequences` left as they were, once it was lost, is
  // starting or is being drained (a peer's view of it was stale).
  bool adopt(std::vector<SequencePtr>& sequences);
  // Wakes the scheduling thread (parked sequences wait for it).
  void wake() { notify(); }
  // Whether there is nothing to compute or hand over here (a drain's end).
  bool idleNow() const;
  // Sequences this scheduler holds or was handed and has not started (a placement signal).
  size_t load() const;
  // Runs `done` on the scheduling thread after the next step this worker completes.
  void afterNextStep(std::function<void()> done);
  // Takes this worker out of service for an operator: its sequences move to the other workers
  // (hand_off must take them all, or the worker keeps serving and FAILED_PRECONDITION says why),
  // then it is shut down. It stays stopped until restartWorker(). Returns the sequences moved.
  Result<uint32_t> retire(std::chrono::milliseconds timeout);
  bool retired() const;
  // An operator's drain of this worker was asked for and is not done yet.
  bool retiring() const;
  const std::string& workerName() const { return links_.worker_name; }
  // How long a restart may take (an operator's, or the one that disarms an undetected fault): a
  // new worker's start, which loads the model.
  static constexpr std::chrono::milliseconds kRestartTimeout{120'000};
  // Replaces the worker; in-flight sequences are replayed. Returns {old, new} incarnations.
  Result<std::pair<uint64_t, uint64_t>> restartWorker(std::chrono::milliseconds timeout);
  // Injects one fault (the worker must run with fault injection) and waits until it is detected
  // and service has recovered, or `timeout`. `random` picks rows, bits and offsets. A fault not
  // detected in time is disarmed by replacing the worker (waiting up to kRestartTimeout for the
  // new one), unless `keep_armed`.
  Result<InjectionOutcome> injectFault(Fault fault, uint64_t random,
                                       std::chrono::milliseconds timeout, bool keep_armed = false);

  SchedulerStats stats() const { return board_.withLatencies(); }
  WorkerStatus workerStatus() const { return board_.worker(); }
  // The counters and histograms, for the metrics endpoint (thread-safe).
  const StatsBoard& board() const { return board_; }

 private:
  void run();
  bool serveOnce();
  void notify();
  void sleepUntilWork();
  void handleRestart();
  void handleRetire();
  // A worker of a new incarnation: its empty cache, and the sampling pool's spinners beside it.
  void meetWorker(const WorkerHello& hello);
  // Offers the waiting sequences to the other workers (SchedulerLinks::hand_off).
  void handOff(bool may_park = true);
  void publishCounts();
  // A step sent to the worker whose reply has not been taken.
  struct InFlightStep {
    uint64_t step_id = 0;
    std::vector<Sequence*> batch;
    std::vector<PlannedChunk> chunks;
    bool ride = false;  // the canary's row follows the batch's rows
    uint32_t first_slot = 0;
    std::chrono::steady_clock::time_point sent;
    bool halves = false;  // sent while two steps go at a time
  };
  // A used reply, where the pace to the next one starts (StepCosts::recordPace): when, in which
  // mode, and how many sequences were running then.
  struct PaceFrom {
    std::chrono::steady_clock::time_point at;
    bool halves = false;
    uint32_t running = 0;
  };
  static bool gated(const WorkerConnection& worker);
  size_t stepDepth(const WorkerConnection& worker) const;
  // Sends steps while fewer than the depth are in flight, then takes the oldest reply; false
  // when there was nothing to compute.
  bool stepOnce(WorkerConnection& worker);
  bool sendStep(WorkerConnection& worker, size_t depth);
  void completeStep(WorkerConnection& worker);
  // Records a completed step's costs and decides whether the next steps go two at a time.
  void choosePipelining(const WorkerConnection& worker, const InFlightStep& step,
                        const std::optional<PaceFrom>& from,
                        std::chrono::steady_clock::time_point done, double compute_ms,
                        double trip_ms, double sample_ms);
  // Beside a worker whose compute grows with its rows: the two modes' paces decide.
  void choosePipeliningByPace(const InFlightStep& step, bool decode_only,
                              const std::optional<PaceFrom>& from,
                              std::chrono::steady_clock::time_point done);
  // Takes every step in flight (before anything but a step is sent to the worker).
  void drainSteps();
  // The worker is gone (or every sequence requeued): its steps in flight never come back.
  void forgetInFlight();
  void handleStepFailure(const WorkerFailure& f, const std::vector<Sequence*>& batch);
  WorkerFailure sampleRows(const std::vector<Sequence*>& batch,
                           std::span<const PlannedChunk> chunks, const StepReply& reply, bool ride,
                           uint64_t step_id, std::vector<SampledRow>& sampled);
  void applyScrub(const ScrubStatus& scrub, bool gated);
  void setServing(bool serving);
  void onFinished(const Status& status);
  void onCrashLoop(const std::string& why);
  // Everything this scheduler holds fails with UNAVAILABLE (a crash loop), after what another
  // worker can take went there.
  void failWaiting(const std::string& why);
  // idleNow() with mu_ held: what the loop last saw of its queues, not the board's counts
  // (published after a pass: a request just taken from `incoming_` would read as none).
  bool idleLocked() const { return incoming_.empty() && adopted_.empty() && queues_empty_; }
  static WorkerSlotOptions slotOptions(const SchedulerOptions& o, const ModelLimits& model);

  const ModelLimits model_;
  const SchedulerOptions options_;
  const SchedulerLinks links_;
  WorkPool& pool_;      // verification and sampling (shared with the other workers' schedulers)
  RowSampler sampler_;  // the scheduler thread's; scratch kept between steps
  StatsBoard board_;
  std::shared_ptr<CanaryStore> canaries_;
  FaultInjector injector_;

  // Shared with RPC threads, under mu_.
  mutable std::mutex mu_;
  std::condition_variable idle_;  // drains and restarts wait on it
  std::deque<SequencePtr> incoming_;
  std::vector<SequencePtr> adopted_;
  std::vector<std::function<void()>> after_step_;
  // What the queues held as the loop last took the incoming requests (load(): it only shrinks
  // until the next pass).
  size_t held_ = 0;
  // Whether the queues held nothing, as the loop last looked (a drain's end: the board's counts
  // lag behind the queues).
  bool queues_empty_ = true;
  bool stopping_ = false;
  // An operator's drain of this worker alone: asked for, then done (the worker stopped), and why
  // it could not be done.
  bool retire_requested_ = false;
  bool retired_ = false;
  std::optional<Status> retire_refused_;
  uint32_t retired_moved_ = 0;
  bool draining_ = false;
  bool restart_requested_ = false;
  bool failed_ = false;  // a crash loop: submissions get UNAVAILABLE
  // The worker serves: sequences moved from elsewhere are taken (false from its loss or a
  // drain until a start succeeds).
  bool accepting_ = false;
  std::optional<Status> restart_failed_;  // why the last operator restart's start failed
  std::string failed_why_;
  std::pair<uint64_t, uint64_t> last_restart_{0, 0};
  std::function<void(bool)> serving_callback_;
  bool serving_ = false;
  uint32_t finished_while_draining_ = 0;
  uint64_t next_sequence_id_ = 1;

  // Scheduler thread only.
  int wake_fd_ = -1;
  std::thread thread_;
  SequenceQueues queues_;
  WorkerSlot slot_;
  uint64_t blocks_incarnation_ = 0;  // the worker the KV blocks were sized for
  // Integrity failures since a step last passed. While there are any, one step at a time, so the
  // step that retries decides alone whether the worker recovered.
  uint32_t step_failures_in_a_row_ = 0;
  // Steps with lower ids were sent before a step failed its integrity checks: their rows are
  // never used, whatever their own checks say (a fault that only the canary sees passes them).
  uint64_t trusted_from_step_ = 0;
  std::chrono::steady_clock::time_point last_vouch_{};
  // The last step's reply when the loop went straight on from it (for between_steps_ms).
  std::optional<std::chrono::steady_clock::time_point> last_reply_;
  std::deque<InFlightStep> in_flight_;  // oldest first
  bool pipelining_ = false;             // see SchedulerOptions::pipeline_sample_share
  StepCosts step_costs_;                // decode steps by row count: whether halves pay
  uint32_t halves_unmeasured_ = 0;      // half steps taken while a whole one's cost is unknown
  std::optional<PaceFrom> pace_from_;   // the last used reply's
  bool beside_cpu_worker_ = false;      // see SchedulerOptions::cpu_worker_sampling_threads
};

}  // namespace bulkhead
