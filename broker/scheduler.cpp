// Scheduler: the request queue and the scheduling loop — admission, stop conditions, rollback
// and replay. Steps (packing, sending, sampling, release) live in broker/scheduler_steps.cpp,
// worker life in broker/worker_slot.
#include "broker/scheduler.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "broker/batch_planner.h"
#include "broker/step_rows.h"

namespace bulkhead {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Scheduler::Scheduler(WorkerFactory factory, ModelLimits model, SchedulerOptions options,
                     WorkPool& pool, SchedulerLinks links)
    : model_(std::move(model)),
      options_(std::move(options)),
      links_(std::move(links)),
      pool_(pool),
      sampler_(pool),
      canaries_(links_.canaries
                    ? links_.canaries
                    : std::make_shared<CanaryStore>(options_.state_dir, options_.pinned_canary)),
      queues_(model_.max_context, model_.eos_token_ids,
              [this](const Status& status) { onFinished(status); }),
      slot_(std::move(factory), slotOptions(options_, model_), *canaries_, sampler_, injector_,
            board_,
            WorkerSlot::Callbacks{
                .lost =
                    [this](const std::string&) {
                      {
                        std::lock_guard lock(mu_);
                        accepting_ = false;
                      }
                      forgetInFlight();
                      queues_.workerLost();
                      if (queues_.empty() && links_.served_elsewhere) {
                        if (auto done = injector_.migrationCallback())
                          links_.served_elsewhere(std::move(done));
                      }
                      handOff();
                    },
                .crash_loop = [this](const std::string& why) { onCrashLoop(why); },
                .fail_waiting = [this](const std::string& why) { failWaiting(why); },
                .serving = [this](bool serving) { setServing(serving); },
                .recovered =
                    [this] {
                      std::lock_guard lock(mu_);
                      failed_ = false;
                      accepting_ = !retire_requested_ && !retired_;
                    }}) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

WorkerSlotOptions Scheduler::slotOptions(const SchedulerOptions& o, const ModelLimits& model) {
  return {.supervision = {.max_consecutive_failures = o.max_consecutive_failures,
                          .backoff_initial = o.restart_backoff_initial,
                          .backoff_max = o.restart_backoff_max},
          .request_timeout = o.step_timeout_base,
          .canary_interval = o.canary_interval,
          .canary_every_steps = o.canary_every_steps,
          .reference = o.canary_reference,
          .heartbeat_interval = o.heartbeat_interval,
          .vocab_size = model.vocab_size};
}

void Scheduler::onFinished(const Status& status) {
  board_.update([&](SchedulerStats& s, WorkerStatus&) {
    ++(status.ok() ? s.requests_completed : s.requests_failed);
  });
  std::lock_guard lock(mu_);
  if (draining_) ++finished_while_draining_;
}

void Scheduler::onCrashLoop(const std::string& why) {
  std::lock_guard lock(mu_);
  failed_ = true;
  failed_why_ = why;
}

void Scheduler::failWaiting(const std::string& why) {
  forgetInFlight();
  handOff();
  const Status status = unavailable("no healthy worker: " + why);
  queues_.failAll(status);
  if (links_.stopped_serving) links_.stopped_serving(status);
}

Scheduler::~Scheduler() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Scheduler::start() {
  thread_ = std::thread([this] { run(); });
}

void Scheduler::requestStop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  injector_.stop();
  // Admin calls waiting on idle_ return now, even if the scheduling thread never ran.
  idle_.notify_all();
  notify();
}

void Scheduler::stop() {
  requestStop();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::notify() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Scheduler::setServingCallback(std::function<void(bool)> callback) {
  std::lock_guard lock(mu_);
  serving_callback_ = std::move(callback);
  if (serving_callback_) serving_callback_(serving_);
}

void Scheduler::setServing(bool serving) {
  std::function<void(bool)> callback;
  {
    std::lock_guard lock(mu_);
    if (serving) failed_ = false;  // a start succeeded: the crash loop is over
    if (serving_ == serving) return;
    if (serving && draining_) return;  // a drained broker stays NOT_SERVING
    serving_ = serving;
    callback = serving_callback_;
  }
  if (callback) callback(serving);
}

Status Scheduler::submit(GenerationRequest request, std::shared_ptr<TokenSink> sink) {
  auto seq = std::make_unique<Sequence>(std::move(request), std::move(sink));
  const size_t prompt = seq->request.prompt.size();
  Status refused;
  {
    std::lock_guard lock(mu_);
    const size_t queued = incoming_.size() + board_.stats().requests_waiting;
    if (draining_ || stopping_) {
      refused = unavailable("the broker is draining and admits no new requests");
    } else if (failed_) {
      refused = unavailable("no healthy worker: " + failed_why_);
    } else if (queued >= options_.max_waiting) {
      refused = resourceExhausted("the request queue is full (" +
                                  std::to_string(options_.max_waiting) + " waiting)");
    } else {
      seq->id = links_.sequence_ids ? links_.sequence_ids->fetch_add(1) : next_sequence_id_++;
      incoming_.push_back(std::move(seq));
    }
  }
  board_.update([&](SchedulerStats& s, WorkerStatus&) {
    ++s.requests_received;
    if (!refused.ok()) ++s.requests_rejected;
    if (refused.ok()) s.prompt_tokens += prompt;
  });
  if (refused.ok()) notify();
  return refused;
}

void Scheduler::run() {
  while (true) {
    if (options_.alive) options_.alive();
    {
      std::lock_guard lock(mu_);
      if (stopping_) break;
      while (!incoming_.empty()) {
        queues_.waiting().push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
      if (!adopted_.empty()) queues_.adopt(std::move(adopted_));
      adopted_.clear();
      held_ = queues_.open() + queues_.waiting().size();
      queues_empty_ = queues_.empty();
    }
    const bool worked = serveOnce();
    const bool idle = queues_.empty();
    publishCounts();
    std::unique_lock lock(mu_);
    queues_empty_ = idle;
    if (idle && incoming_.empty()) idle_.notify_all();
    if (worked || !incoming_.empty() || !adopted_.empty() || stopping_) continue;
    lock.unlock();
    last_reply_.reset();  // the next step follows a wait for work, not this one's reply
    pace_from_.reset();   // nor does its pace
    sleepUntilWork();
  }
  // Shutting down: every open request ends.
  drainSteps();
  queues_.failAll(unavailable("the broker is shutting down"));
  std::deque<SequencePtr> incoming;
  {
    std::lock_guard lock(mu_);
    incoming.swap(incoming_);
    for (auto& s : adopted_) incoming.push_back(std::move(s));
    adopted_.clear();
  }
  for (auto& s : incoming) s->sink->onFinish(FinishReason::kNone, {}, unavailable("shutting down"));
  slot_.shutdown();
  publishCounts();
  setServing(false);
  std::lock_guard lock(mu_);
  idle_.notify_all();
}

// One pass of the loop; true when it did work (the loop then goes round without sleeping).
bool Scheduler::serveOnce() {
  bool restart, retire, retired;
  {
    std::lock_guard lock(mu_);
    restart = restart_requested_;
    retire = retire_requested_;
    retired = retired_;
  }
  if (restart) {
    drainSteps();
    handleRestart();
  } else if (retire) {
    handleRetire();
    return true;
  } else if (retired) {
    handOff();  // a request that raced with the drain
    // None could take it, and none ever will: every worker is drained or in a crash loop.
    if (!queues_.empty() && links_.any_alive && !links_.any_alive())
      queues_.failAll(unavailable("no worker can serve: every worker is drained or failing"));
    queues_.dropCancelled(Clock::now());
    return false;
  }
  queues_.dropCancelled(Clock::now());
  slot_.checkExited();
  // While this worker is not ready, what waits for it may go to another that is (a worker
  // starting a large model takes seconds).
  if (slot_.worker() == nullptr) {
    handOff();
    // In a crash loop submissions are refused; what arrived, or was moved here, as the loop began
    // fails now rather than wait for a start that may never succeed.
    if (slot_.state() == WorkerState::kFailed && !queues_.empty()) {
      std::string why;
      {
        std::lock_guard lock(mu_);
        why = failed_why_;
      }
      failWaiting(why);
    }
  }
  if (slot_.worker() == nullptr) {
    // Stopping (on SIGTERM its workers may go at the same moment): a lost one is not replaced.
    std::lock_guard lock(mu_);
    if (stopping_) return false;
  }
  WorkerConnection* worker = slot_.ensure();
  if (worker == nullptr) return false;
  if (links_.claim_parked) {
    std::vector<SequencePtr> parked;
    links_.claim_parked(parked);
    if (!parked.empty()) queues_.adopt(std::move(parked));
  }
  if (worker->hello().incarnation != blocks_incarnation_) meetWorker(worker->hello());
  if (slot_.faultPending()) {
    drainSteps();
    slot_.armPendingFault(options_.step_timeout_base);
  }
  if (slot_.worker() == nullptr) return true;  // arming found the worker gone
  queues_.admit(options_.max_running);
  // A stopped sequence waits only for its last tokens to be vouched for; rather than wait for the
  // background pass (its client's next request waits too), ask for a full pass now and then. With
  // nothing left to compute, ask at once.
  const bool computing = !queues_.running().empty();
  if (computing
          ? queues_.hasFinishing() && Clock::now() - last_vouch_ >= options_.finish_vouch_interval
          : queues_.hasUnreleased()) {
    drainSteps();
    last_vouch_ = Clock::now();
    if (slot_.worker() == nullptr) return true;
    if (auto scrub = slot_.vouch()) applyScrub(*scrub, gated(*slot_.worker()));
    if (!computing || slot_.worker() == nullptr) return true;
  }
  if (!queues_.running().empty()) return stepOnce(*slot_.worker());
  slot_.idle();
  return false;
}

void Scheduler::meetWorker(const WorkerHello& hello) {
  // A new worker's cache is empty (every sequence was requeued when the last one was lost).
  queues_.resetBlocks(hello.kv_block_count, hello.kv_block_size, slot_.reservedBlocks());
  blocks_incarnation_ = hello.incarnation;
  // Failed steps in a row count for one worker: the new one starts with its retries whole.
  step_failures_in_a_row_ = 0;
  beside_cpu_worker_ = options_.cpu_worker_sampling_threads > 0 && hello.backend == "cpu";
  pool_.setSpinners(beside_cpu_worker_ ? options_.cpu_worker_warm_spinners
                                       : options_.warm_spinners);
}

void Scheduler::handOff(bool may_park) {
  if (!links_.hand_off || queues_.waiting().empty()) return;
  std::vector<SequencePtr> moving = queues_.takeWaiting();
  // Timed from the first move that has not resumed yet; recovery from this worker's fault (if
  // one is being injected) is the first moved sequence's first token elsewhere.
  const Sequence::Migration migration{Clock::now(), injector_.migrationCallback()};
  std::vector<const Sequence*> marked;
  for (auto& s : moving) {
    if (s->migration) continue;
    s->migration = migration;
    marked.push_back(s.get());
  }
  // Counted before they leave: a moved sequence may finish on another worker before the hand-off
  // returns, and whoever sees it finished must see it counted. Those that stay are taken back.
  const size_t offered = moving.size();
  board_.update([&](SchedulerStats& s, WorkerStatus&) { s.migrated_sequences += offered; });
  const size_t moved = links_.hand_off(moving, may_park);
  board_.update([&](SchedulerStats& s, WorkerStatus&) { s.migrated_sequences -= offered - moved; });
  for (auto& s : moving)  // stays here
    if (std::find(marked.begin(), marked.end(), s.get()) != marked.end()) s->migration.reset();
  if (moved != 0)
    spdlog::info("{} sequences moved from {} to other workers", moved, links_.worker_name);
  queues_.adopt(std::move(moving));
}

void Scheduler::afterNextStep(std::function<void()> done) {
  std::lock_guard lock(mu_);
  after_step_.push_back(std::move(done));
}

bool Scheduler::adopt(std::vector<SequencePtr>& sequences) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_ && !accepting_) return false;
    // Once stopping, the loop's last pass may have ended: they end here.
    if (!stopping_) {
      for (auto& s : sequences) adopted_.push_back(std::move(s));
      sequences.clear();
    }
  }
  for (auto& s : sequences)
    s->sink->onFinish(FinishReason::kNone, {}, unavailable("the broker is shutting down"));
  sequences.clear();
  notify();
  return true;
}

bool Scheduler::idleNow() const {
  std::lock_guard lock(mu_);
  return idleLocked();
}

size_t Scheduler::load() const {
  std::lock_guard lock(mu_);
  return incoming_.size() + adopted_.size() + held_;
}

void Scheduler::publishCounts() {
  const QueueCounters& c = queues_.counters();
  board_.update([&](SchedulerStats& s, WorkerStatus& w) {
    s.requests_running = uint32_t(queues_.open());
    s.requests_waiting = uint32_t(queues_.waiting().size());
    s.preemptions = c.preemptions;
    s.replayed_sequences = c.replayed;
    s.rolled_back_tokens = c.rolled_back;
    w.kv_blocks_free = queues_.blocks().freeCount();
  });
}

void Scheduler::sleepUntilWork() {
  // Wakes on a notification, on the worker process exiting, or at the next duty: a start attempt,
  // a canary or heartbeat, or the nearest request deadline.
  auto until = Clock::now() + std::chrono::seconds(1);
  if (!retired()) until = std::min(until, slot_.nextDuty());
  for (const auto& s : queues_.waiting())
    if (s->request.deadline) until = std::min(until, *s->request.deadline);
  const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
  pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {slot_.exitFd(), POLLIN, 0}};
  if (::poll(fds, fds[1].fd >= 0 ? 2 : 1, int(std::clamp<int64_t>(left, 0, 60'000))) > 0) {
    uint64_t value;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &value, sizeof(value));
  }
}

}  // namespace bulkhead
