// WorkerSlot: start, canary, heartbeat, replacement and fault arming of one worker.
#include "broker/worker_slot.h"

#include <poll.h>

#include <algorithm>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "broker/sampler.h"
#include "shared/logging.h"

namespace bulkhead {

WorkerSlot::WorkerSlot(WorkerFactory factory, WorkerSlotOptions options, CanaryStore& canaries,
                       RowSampler& sampler, FaultInjector& injector, StatsBoard& board,
                       Callbacks callbacks)
    : factory_(std::move(factory)),
      options_(std::move(options)),
      canaries_(canaries),
      sampler_(sampler),
      injector_(injector),
      board_(board),
      callbacks_(std::move(callbacks)),
      supervision_(options_.supervision) {}

WorkerSlot::~WorkerSlot() = default;

WorkerConnection* WorkerSlot::ensure() {
  if (ready_) return worker_.get();
  if (!supervision_.mayStart(Clock::now())) return nullptr;
  return start() ? worker_.get() : nullptr;
}

bool WorkerSlot::start() {
  const uint64_t incarnation = next_incarnation_++;
  supervision_.onStarting();
  board_.update([&](SchedulerStats&, WorkerStatus& w) {
    w.state = std::string(workerStateName(supervision_.state()));
  });
  auto started = factory_(incarnation);
  if (!started.ok()) {
    const std::string why = "start failed: " + started.error().toString();
    spdlog::error("worker start {} failed: {}", incarnation, started.error().toString());
    failed(why);
    replace("start failed", why);
    return false;
  }
  worker_ = std::move(*started);
  const WorkerHello& h = worker_->hello();
  // The scheduler thread's lines are about this worker from here on (its canary's first).
  setThreadLogFields({.worker = std::to_string(h.pid), .incarnation = h.incarnation});
  if (h.vocab_size != options_.vocab_size) {
    replace("vocabulary mismatch", "worker reports vocabulary " + std::to_string(h.vocab_size) +
                                       ", the model has " + std::to_string(options_.vocab_size));
    return false;
  }
  last_contact_ = Clock::now();
  if (!passesCanary()) return false;
  ready_ = true;
  supervision_.onReady();
  // In this order: the crash loop ends, so whoever sees the state "ready" can submit; then the
  // state, so whoever learns that the broker serves (health, its ready line) finds it "ready".
  callbacks_.recovered();
  board_.update([&](SchedulerStats&, WorkerStatus& w) {
    w.state = std::string(workerStateName(supervision_.state()));
    w.incarnation = h.incarnation;
    w.pid = h.pid;
    w.backend = h.backend;
    w.kv_blocks_total = h.kv_block_count - reservedBlocks();  // the canary holds the rest
    w.kv_block_size = h.kv_block_size;
    w.weight_bytes = h.weight_bytes - std::min(h.weight_bytes, h.streamed_weight_bytes);
    w.streamed_weight_bytes = h.streamed_weight_bytes;
    w.last_step = w.scrub_clean_through = 0;
  });
  callbacks_.serving(true);
  spdlog::info("worker incarnation {} ready (pid {}, {} backend, {} KV blocks)", h.incarnation,
               h.pid, h.backend, h.kv_block_count);
  return true;
}

bool WorkerSlot::passesCanary() {
  const WorkerHello& h = worker_->hello();
  canary_ = CanaryPlan::forWorker(h);
  if (!canary_) {
    spdlog::warn("the worker is too small for the canary; serving without it");
    return true;
  }
  ride_ = canary_->ride();
  auto run = runCanary(
      *worker_, sampler_, *canary_, [this] { return nextStepId(); }, options_.request_timeout);
  last_canary_ = last_contact_ = Clock::now();
  board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.canary_runs; });
  Status s = run.status();
  if (run.ok()) {
    const auto qualifying = canaries_.qualifying();
    s = canaries_.check(h.model_identity, h.backend, h.weight_digest, run->digest);
    if (s.code() == Code::kNotFound) {
      // No record vouches for this model and backend yet: the reference engine must.
      s = qualifyCanary(h, *canary_, *run, options_.reference);
      if (s.ok()) canaries_.record(h.model_identity, h.backend, h.weight_digest, run->digest);
    }
  }
  if (s.ok()) {
    ride_checksum_ = run->checksums[1];
    steps_since_ride_ = 0;
    return true;
  }
  quarantine(s.message());
  return false;
}

bool WorkerSlot::passesRide() {
  auto row = runCanaryStep(*worker_, sampler_, ride_, nextStepId(), options_.request_timeout);
  last_canary_ = last_contact_ = Clock::now();
  std::string why;
  if (!row.ok()) {
    board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.canary_runs; });
    why = row.status().message();
  } else if (WorkerFailure bad = checkRide(row->checksum, 0); !bad.ok()) {  // counts the run
    why = bad.message;
  } else {
    return true;
  }
  failed(why);
  replace("canary", why);
  return false;
}

const SequenceStep* WorkerSlot::canaryRide() const {
  if (!ready_ || !canary_ || options_.canary_every_steps == 0) return nullptr;
  return steps_since_ride_ + 1 >= options_.canary_every_steps ? &ride_ : nullptr;
}

WorkerFailure WorkerSlot::checkRide(uint64_t row_checksum, uint64_t step_id) {
  const bool ok = row_checksum == ride_checksum_;
  rode_ = ok;  // a failed ride stays due: the retry carries the canary again
  board_.update([&](SchedulerStats& s, WorkerStatus&) {
    ++s.canary_runs;
    if (!ok) ++s.canary_failures;
  });
  if (ok) return {};
  char buf[160];
  std::snprintf(buf, sizeof(buf), "has checksum %016llx, the qualified one is %016llx",
                static_cast<unsigned long long>(row_checksum),
                static_cast<unsigned long long>(ride_checksum_));
  WorkerFailure f =
      workerFailure(WorkerFailure::Kind::kIntegrityFailure,
                    (step_id ? "the canary row riding along with step " + std::to_string(step_id)
                             : std::string("the idle canary's row")) +
                        " " + buf);
  f.check = IntegrityCheck::kCanary;
  return f;
}

void WorkerSlot::quarantine(const std::string& why) {
  spdlog::error("worker incarnation {} quarantined: {}", worker_->hello().incarnation, why);
  board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.canary_failures; });
  failed(why);
  replace("canary", why);
}

void WorkerSlot::checkExited() {
  if (!worker_ || worker_->exitFd() < 0) return;
  pollfd p{worker_->exitFd(), POLLIN, 0};
  if (::poll(&p, 1, 0) > 0) {
    failed("worker exited");
    replace("worker exited", "worker process exited while idle");
  }
}

void WorkerSlot::idle() {
  if (!ready_) return;
  const auto now = Clock::now();
  if (options_.canary_interval.count() > 0 && now - last_canary_ >= options_.canary_interval) {
    if (!canary_ || passesRide()) last_contact_ = Clock::now();
    return;
  }
  if (now - last_contact_ < options_.heartbeat_interval) return;
  const WorkerFailure beat = worker_->heartbeat(options_.request_timeout);
  if (beat.ok()) {
    last_contact_ = Clock::now();
    return;
  }
  failed(std::string(workerFailureKindName(beat.kind)));
  replace(workerFailureKindName(beat.kind), "heartbeat: " + beat.toString());
}

WorkerSlot::Clock::time_point WorkerSlot::nextDuty() const {
  if (!worker_) return supervision_.nextStartAt();
  auto at = last_contact_ + options_.heartbeat_interval;
  if (options_.canary_interval.count() > 0)
    at = std::min(at, last_canary_ + options_.canary_interval);
  return at;
}

void WorkerSlot::stepCompleted() {
  last_contact_ = Clock::now();
  supervision_.onStepCompleted();
  injector_.stepCompleted();
  steps_since_ride_ = rode_ ? 0 : steps_since_ride_ + 1;
  rode_ = false;
}

void WorkerSlot::failed(const std::string& what) {
  injector_.failureSeen(what);
}

void WorkerSlot::replace(std::string_view cause, const std::string& why, bool operator_request) {
  const bool had_worker = worker_ != nullptr;
  if (had_worker)
    spdlog::warn("replacing worker incarnation {}: {}", worker_->hello().incarnation, why);
  worker_.reset();  // SIGKILLs a worker that is still running
  ready_ = false;
  bool crash_loop = false;
  if (operator_request) {
    supervision_.onOperatorRestart(Clock::now());
  } else {
    crash_loop = supervision_.onFailure(Clock::now());
  }
  // In this order: whoever sees the state "failed" finds submissions refused, and whoever sees a
  // request fail finds the state "failed"; and the state leaves "ready" before the sequences move,
  // so that nobody places work on, or waits for a step from, the worker just lost.
  if (crash_loop) {
    spdlog::error("worker failed {} times in a row; failing requests until a start succeeds",
                  supervision_.consecutiveFailures());
    callbacks_.crash_loop(why);
  }
  board_.update([&](SchedulerStats& s, WorkerStatus& w) {
    if (had_worker) {
      ++s.worker_restarts;
      ++s.restarts_by_cause[std::string(cause)];
      ++w.restarts;
    }
    w.last_failure = why;
    w.state = std::string(workerStateName(supervision_.state()));
  });
  if (had_worker) callbacks_.lost(why);
  if (crash_loop) {
    callbacks_.serving(false);
    callbacks_.fail_waiting(why);
  }
}

void WorkerSlot::armPendingFault(std::chrono::milliseconds step_timeout) {
  if (faultPending()) injector_.arm(*worker_, step_timeout);
}

bool WorkerSlot::faultPending() const {
  return ready_ && injector_.pending();
}

std::optional<ScrubStatus> WorkerSlot::vouch() {
  if (!ready_) return std::nullopt;
  auto scrub = worker_->ping(options_.request_timeout);
  if (scrub.ok()) {
    last_contact_ = Clock::now();
    return std::move(*scrub);
  }
  failed(std::string(workerFailureKindName(scrub.error().kind)));
  replace(workerFailureKindName(scrub.error().kind), scrub.error().toString());
  return std::nullopt;
}

void WorkerSlot::shutdown() {
  supervision_.onStopped();
  board_.update([](SchedulerStats&, WorkerStatus& w) {
    w.state = "stopped";
    w.pid = 0;  // no process any more
  });
  if (worker_) {
    (void)worker_->shutdown(std::chrono::seconds(10));
    worker_.reset();
  }
  ready_ = false;
}

void WorkerSlot::resume() {
  supervision_.onResumed(Clock::now());
  board_.update([](SchedulerStats&, WorkerStatus& w) { w.state = "starting"; });
}

}  // namespace bulkhead
