// Router: placement, moving sequences between workers, and the broker-wide views.
#include "broker/router.h"

#include <algorithm>
#include <thread>

#include <spdlog/spdlog.h>

namespace bulkhead {

Router::Router(std::vector<WorkerFactory> factories, ModelLimits model, SchedulerOptions options,
               WorkPool& pool) {
  const size_t n = std::max<size_t>(1, factories.size());
  if (n > 1) options.max_waiting = uint32_t((options.max_waiting + n - 1) / n);
  auto canaries = std::make_shared<CanaryStore>(options.state_dir, options.pinned_canary);
  auto ids = std::make_shared<std::atomic<uint64_t>>(1);
  serving_.assign(factories.size(), false);
  // The watchdog is pinged once every scheduling loop has gone round since the last ping, so a
  // single stuck loop is noticed.
  const std::function<void()> alive = options.alive;
  beats_ = std::make_unique<std::atomic<bool>[]>(factories.size());
  for (size_t i = 0; i < factories.size(); ++i) {
    if (alive)
      options.alive = [this, i, alive, n = factories.size()] {
        beats_[i].store(true);
        for (size_t k = 0; k < n; ++k)
          if (!beats_[k].load()) return;
        for (size_t k = 0; k < n; ++k) beats_[k].store(false);
        alive();
      };
    SchedulerLinks links{.worker_name = "worker-" + std::to_string(i),
                         .canaries = canaries,
                         .sequence_ids = ids,
                         .hand_off = {},
                         .claim_parked = {},
                         .stopped_serving = {},
                         .any_alive = {},
                         .served_elsewhere = {}};
    if (factories.size() > 1) {
      links.hand_off = [this, i](std::vector<SequencePtr>& s, bool may_park) {
        return handOff(i, s, may_park);
      };
      links.claim_parked = [this, i](std::vector<SequencePtr>& into) { claimParked(i, into); };
      links.stopped_serving = [this, i](const Status& status) {
        if (!anyAlive()) {
          failParked(status);
          return;
        }
        // Parked sequences only this worker could hold go to a ready one now (claimParked).
        if (parked_count_.load() == 0) return;
        for (size_t j = 0; j < schedulers_.size(); ++j)
          if (j != i && ready(j)) schedulers_[j]->wake();
      };
      links.any_alive = [this] { return anyAlive(); };
      links.served_elsewhere = [this, i](std::function<void()> done) {
        for (size_t k = 1; k < schedulers_.size(); ++k) {
          const size_t j = (i + k) % schedulers_.size();
          if (!ready(j)) continue;
          schedulers_[j]->afterNextStep(std::move(done));
          return;
        }
      };
    }
    schedulers_.push_back(std::make_unique<Scheduler>(std::move(factories[i]), model, options, pool,
                                                      std::move(links)));
  }
}

Router::~Router() {
  stop();
}

void Router::start() {
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    schedulers_[i]->setServingCallback([this, i](bool serving) { servingChanged(i, serving); });
    schedulers_[i]->start();
  }
}

void Router::stop() {
  // Every thread stops before any scheduler is destroyed: a moving sequence may be handed to any.
  // All are asked first, so that none replaces a worker lost while another one stops.
  for (auto& s : schedulers_) s->requestStop();
  for (auto& s : schedulers_) s->stop();
  failParked(unavailable("the broker is shutting down"));
}

void Router::setServingCallback(std::function<void(bool)> callback) {
  std::lock_guard lock(mu_);
  serving_callback_ = std::move(callback);
  if (serving_callback_) serving_callback_(any_serving_);
}

void Router::servingChanged(size_t i, bool serving) {
  // Held while calling out, so that the callback sees the changes in the order they happened.
  std::lock_guard lock(mu_);
  serving_[i] = serving;
  const bool any = std::find(serving_.begin(), serving_.end(), true) != serving_.end();
  if (any == any_serving_) return;
  any_serving_ = any;
  if (serving_callback_) serving_callback_(any);
}

bool Router::ready(size_t i) const {
  return !schedulers_[i]->retired() && !schedulers_[i]->retiring() &&
         schedulers_[i]->workerStatus().state == "ready";
}

size_t Router::place(uint64_t positions) const {
  if (schedulers_.size() == 1) return 0;
  size_t best = schedulers_.size();
  size_t best_load = 0;
  uint32_t best_free = 0;
  for (int pass = 0; pass < 4 && best == schedulers_.size(); ++pass) {
    for (size_t i = 0; i < schedulers_.size(); ++i) {
      // Ready workers whose cache holds the request, then any not drained that holds it (the
      // request waits for it); then the same without the cache (its admission refuses it, saying
      // why).
      const bool candidate =
          pass % 2 == 0 ? ready(i) : !schedulers_[i]->retired() && !schedulers_[i]->retiring();
      if (!candidate) continue;
      const WorkerStatus status = schedulers_[i]->workerStatus();
      if (pass < 2 && !status.holds(positions)) continue;
      const size_t load = schedulers_[i]->load();
      const uint32_t free = status.kv_blocks_free;
      if (best == schedulers_.size() || load < best_load ||
          (load == best_load && free > best_free)) {
        best = i;
        best_load = load;
        best_free = free;
      }
    }
  }
  return best == schedulers_.size() ? 0 : best;
}

Status Router::submit(GenerationRequest request, std::shared_ptr<TokenSink> sink) {
  const size_t at = place(uint64_t(request.prompt.size()) + request.max_tokens);
  return schedulers_[at]->submit(std::move(request), std::move(sink));
}

size_t Router::handOff(size_t from, std::vector<SequencePtr>& sequences, bool may_park) {
  struct Peer {
    size_t index, load;
    WorkerStatus status;
    std::vector<SequencePtr> taken;
  };
  std::vector<Peer> peers;
  for (size_t i = 0; i < schedulers_.size(); ++i)
    if (i != from && ready(i))
      peers.push_back({i, schedulers_[i]->load(), schedulers_[i]->workerStatus(), {}});
  if (peers.empty()) {
    if (may_park) park(from, sequences);
    return 0;
  }
  // Each to the least loaded peer whose cache can hold it; one that none can hold stays (or waits
  // in the router for a worker that can) rather than fail part-way on a smaller cache.
  std::vector<SequencePtr> left;
  for (SequencePtr& s : sequences) {
    Peer* best = nullptr;
    for (Peer& p : peers) {
      if (!p.status.holds(s->mostPositions())) continue;
      if (best == nullptr || p.load < best->load ||
          (p.load == best->load && p.status.kv_blocks_free > best->status.kv_blocks_free))
        best = &p;
    }
    if (best == nullptr) {
      left.push_back(std::move(s));
      continue;
    }
    best->taken.push_back(std::move(s));
    ++best->load;
  }
  sequences = std::move(left);
  // A peer lost or drained since it read "ready" refuses them: they stay, or wait in the router.
  size_t moved = 0;
  for (Peer& p : peers) {
    const size_t n = p.taken.size();
    if (n == 0) continue;
    if (schedulers_[p.index]->adopt(p.taken)) {
      moved += n;
    } else {
      for (SequencePtr& s : p.taken) sequences.push_back(std::move(s));
    }
  }
  if (!sequences.empty() && may_park) park(from, sequences);
  return moved;
}

void Router::park(size_t from, std::vector<SequencePtr>& sequences) {
  if (!anyAlive()) return;
  size_t parked;
  {
    std::lock_guard lock(parked_mu_);
    for (SequencePtr& s : sequences) parked_.push_back(std::move(s));
    sequences.clear();
    parked = parked_.size();
    parked_count_.store(parked);
  }
  spdlog::info("no other worker is ready: {} sequences wait for the first that is", parked);
  // One that became ready since the hand-off looked claims them on its next pass: wake it.
  for (size_t i = 0; i < schedulers_.size(); ++i)
    if (i != from && ready(i)) schedulers_[i]->wake();
}

void Router::claimParked(size_t claimer, std::vector<SequencePtr>& into) {
  if (parked_count_.load() == 0) return;
  // Those its cache holds; and those no other worker that may still serve could hold, which it
  // takes rather than leave them waiting for nobody (its admission serves one that has begun as
  // far as its cache holds it, and refuses one that has not, saying why).
  // Those whose clients cancelled or whose deadlines passed while they waited end here.
  const WorkerStatus mine = schedulers_[claimer]->workerStatus();
  std::vector<WorkerStatus> others;
  for (size_t i = 0; i < schedulers_.size(); ++i)
    if (i != claimer && alive(i)) others.push_back(schedulers_[i]->workerStatus());
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::pair<SequencePtr, Status>> ended;
  {
    std::lock_guard lock(parked_mu_);
    std::vector<SequencePtr> left;
    for (SequencePtr& s : parked_) {
      if (auto status = endedByClient(*s, now)) {
        ended.emplace_back(std::move(s), std::move(*status));
        continue;
      }
      const uint64_t positions = s->mostPositions();
      const bool elsewhere = std::any_of(others.begin(), others.end(),
                                         [&](const WorkerStatus& w) { return w.holds(positions); });
      (mine.holds(positions) || !elsewhere ? into : left).push_back(std::move(s));
    }
    parked_ = std::move(left);
    parked_count_.store(parked_.size());
  }
  for (auto& [s, status] : ended) s->sink->onFinish(FinishReason::kNone, {}, status);
}

bool Router::alive(size_t i) const {
  if (schedulers_[i]->retired()) return false;
  // "stopped": a drain is stopping its worker (it is retired once that is done).
  const std::string state = schedulers_[i]->workerStatus().state;
  return state != "failed" && state != "stopped";
}

bool Router::anyAlive() const {
  for (size_t i = 0; i < schedulers_.size(); ++i)
    if (alive(i)) return true;
  return false;
}

void Router::failParked(const Status& status) {
  std::vector<SequencePtr> parked;
  {
    std::lock_guard lock(parked_mu_);
    parked.swap(parked_);
    parked_count_.store(0);
  }
  for (SequencePtr& s : parked) s->sink->onFinish(FinishReason::kNone, {}, status);
}

Result<Scheduler*> Router::find(const std::string& name) const {
  if (name.empty()) {
    if (schedulers_.size() == 1) return schedulers_[0].get();
    return invalidArgument("the broker has " + std::to_string(schedulers_.size()) +
                           " workers: name one (worker-0 .. worker-" +
                           std::to_string(schedulers_.size() - 1) + ")");
  }
  for (const auto& s : schedulers_)
    if (s->workerName() == name) return s.get();
  return Status(Code::kNotFound, "no worker named " + name);
}

Result<uint32_t> Router::drain(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& s : schedulers_) s->beginDrain();
  // Rounds until one finds every worker idle and nothing parked: a worker lost while another's
  // drain was awaited hands its sequences on, and those must finish too.
  while (true) {
    for (auto& s : schedulers_) {
      auto n = s->awaitDrained(deadline);
      if (!n.ok()) return n.status();
    }
    bool idle = parked_count_.load() == 0;
    for (auto& s : schedulers_) idle = idle && s->idleNow();
    if (idle) break;
    if (std::chrono::steady_clock::now() >= deadline)
      return Status(Code::kDeadlineExceeded, "drain did not finish in time");
    // Parked sequences wait for a worker's start (seconds): look again shortly.
    if (parked_count_.load() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Each scheduler counts what finished on it since beginDrain; all idle, these are final.
  uint32_t finished = 0;
  for (auto& s : schedulers_) {
    auto n = s->awaitDrained(deadline);
    if (!n.ok()) return n.status();
    finished += *n;
  }
  return finished;
}

Result<uint32_t> Router::drainWorker(const std::string& name, std::chrono::milliseconds timeout) {
  BULKHEAD_ASSIGN_OR_RETURN(Scheduler * target, find(name));
  // Two drains at once could each count on the other's worker to take their sequences.
  std::lock_guard drains(drains_mu_);
  bool other_ready = false;
  std::string others;  // what the others are doing, for the refusal
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    if (schedulers_[i].get() == target) continue;
    other_ready |= ready(i);
    others += (others.empty() ? " (" : ", ") + schedulers_[i]->workerName() + " " +
              (schedulers_[i]->retired() || schedulers_[i]->retiring()
                   ? std::string("drained")
                   : schedulers_[i]->workerStatus().state);
  }
  if (!other_ready && !target->retired())
    return failedPrecondition("no other worker is ready to take " + target->workerName() +
                              "'s sequences" + (others.empty() ? "" : others + ")"));
  return target->retire(timeout);
}

Result<std::pair<uint64_t, uint64_t>> Router::restartWorker(const std::string& name,
                                                            std::chrono::milliseconds timeout) {
  BULKHEAD_ASSIGN_OR_RETURN(Scheduler * target, find(name));
  return target->restartWorker(timeout);
}

Result<InjectionOutcome> Router::injectFault(const std::string& name, Fault fault, uint64_t random,
                                             std::chrono::milliseconds timeout, bool keep_armed) {
  Scheduler* target = nullptr;
  if (name.empty() && schedulers_.size() > 1) {
    std::vector<size_t> candidates;
    for (size_t i = 0; i < schedulers_.size(); ++i)
      if (ready(i)) candidates.push_back(i);
    if (candidates.empty()) return unavailable("no worker is ready for a fault");
    // The high bits: the low ones pick rows and bits inside the worker.
    target = schedulers_[candidates[(random >> 40) % candidates.size()]].get();
  } else {
    BULKHEAD_ASSIGN_OR_RETURN(target, find(name));
  }
  auto outcome = target->injectFault(fault, random, timeout, keep_armed);
  if (outcome.ok()) outcome->worker = target->workerName();
  return outcome;
}

std::vector<const StatsBoard*> Router::boards() const {
  std::vector<const StatsBoard*> out;
  for (const auto& s : schedulers_) out.push_back(&s->board());
  return out;
}

SchedulerStats Router::stats() const {
  SchedulerStats s = StatsBoard::combined(boards());
  // Sequences waiting in the router for a worker wait too, though no scheduler holds them.
  s.requests_waiting += uint32_t(parked_count_.load());
  return s;
}

StatsHistograms Router::histograms() const {
  return StatsBoard::combinedHistograms(boards());
}

std::vector<WorkerView> Router::workers() const {
  std::vector<WorkerView> out;
  for (const auto& s : schedulers_)
    out.push_back({s->workerName(), s->workerStatus(), s->stats(), s->retiring(), s->retired()});
  return out;
}

}  // namespace bulkhead
