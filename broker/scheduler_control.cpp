// Scheduler: what operators ask of it through Admin — drain, an operator restart of the worker,
// and fault injection. The scheduling loop itself lives in broker/scheduler.cpp.
#include "broker/scheduler.h"

#include <spdlog/spdlog.h>

namespace bulkhead {

using std::chrono::milliseconds;

Result<uint32_t> Scheduler::drain(milliseconds timeout) {
  std::unique_lock lock(mu_);
  draining_ = true;
  finished_while_draining_ = 0;
  lock.unlock();
  notify();
  lock.lock();
  const bool done = idle_.wait_for(lock, timeout, [&] {
    const SchedulerStats s = board_.stats();
    return stopping_ || (incoming_.empty() && s.requests_running == 0 && s.requests_waiting == 0);
  });
  if (!done) return Status(Code::kDeadlineExceeded, "drain did not finish in time");
  const uint32_t finished = finished_while_draining_;
  const bool was_serving = serving_;
  auto callback = serving_callback_;
  serving_ = false;
  lock.unlock();
  if (was_serving && callback) callback(false);
  return finished;
}

Result<std::pair<uint64_t, uint64_t>> Scheduler::restartWorker(milliseconds timeout) {
  std::unique_lock lock(mu_);
  restart_requested_ = true;
  lock.unlock();
  notify();
  lock.lock();
  const bool done = idle_.wait_for(lock, timeout, [&] { return !restart_requested_ || stopping_; });
  if (!done || restart_requested_) return unavailable("restart did not complete in time");
  return last_restart_;
}

Result<InjectionOutcome> Scheduler::injectFault(Fault fault, uint64_t random, milliseconds timeout,
                                                bool keep_armed) {
  auto outcome = injector_.inject(fault, random, timeout, [this] { notify(); });
  if (outcome.ok() && !outcome->detected && !keep_armed) {
    // The fault may still be armed on the worker, waiting for a step that fits it. A fresh
    // worker makes sure it can never fire later and be credited to the next injection.
    spdlog::warn("{} was not detected in time; replacing the worker to disarm it",
                 faultName(fault));
    outcome->disarmed = restartWorker(timeout).ok();
  }
  return outcome;
}

void Scheduler::handleRestart() {
  const WorkerConnection* old = slot_.worker();
  const uint64_t old_incarnation = old ? old->hello().incarnation : 0;
  slot_.replace("operator", "restart requested by an operator", /*operator_request=*/true);
  WorkerConnection* now = slot_.ensure();
  std::lock_guard lock(mu_);
  if (now != nullptr) {
    last_restart_ = {old_incarnation, now->hello().incarnation};
    restart_requested_ = false;
    idle_.notify_all();
  }
}

}  // namespace bulkhead
