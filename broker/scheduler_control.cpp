// Scheduler: what operators ask of it through Admin — drain, an operator restart of the worker,
// and fault injection. The scheduling loop itself lives in broker/scheduler.cpp.
#include "broker/scheduler.h"

#include <spdlog/spdlog.h>

namespace bulkhead {

using std::chrono::milliseconds;

Result<uint32_t> Scheduler::drain(milliseconds timeout) {
  beginDrain();
  return awaitDrained(std::chrono::steady_clock::now() + timeout);
}

void Scheduler::beginDrain() {
  {
    std::lock_guard lock(mu_);
    draining_ = true;
    finished_while_draining_ = 0;
  }
  notify();
}

Result<uint32_t> Scheduler::awaitDrained(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lock(mu_);
  const bool done = idle_.wait_until(lock, deadline, [&] { return stopping_ || idleLocked(); });
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
  if (restart_failed_) return *restart_failed_;
  return last_restart_;
}

Result<InjectionOutcome> Scheduler::injectFault(Fault fault, uint64_t random, milliseconds timeout,
                                                bool keep_armed) {
  auto outcome = injector_.inject(fault, random, timeout, [this] { notify(); });
  // (A drained worker has no process left to disarm, and an operator drained it.)
  if (outcome.ok() && !outcome->detected && !keep_armed && !retired()) {
    // The fault may still be armed on the worker, waiting for a step that fits it. A fresh
    // worker makes sure it can never fire later and be credited to the next injection.
    spdlog::warn("{} was not detected in time; replacing the worker to disarm it",
                 faultName(fault));
    outcome->disarmed = restartWorker(kRestartTimeout).ok();
  }
  return outcome;
}

Result<uint32_t> Scheduler::retire(milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (retired_) return 0u;
  retire_requested_ = true;
  accepting_ = false;  // nothing more moves here
  retire_refused_.reset();
  lock.unlock();
  notify();
  lock.lock();
  const bool done = idle_.wait_for(lock, timeout, [&] { return !retire_requested_ || stopping_; });
  if (!done || retire_requested_) return unavailable("the worker's drain did not finish in time");
  if (retire_refused_) return *retire_refused_;
  return retired_moved_;
}

bool Scheduler::retired() const {
  std::lock_guard lock(mu_);
  return retired_;
}

bool Scheduler::retiring() const {
  std::lock_guard lock(mu_);
  return retire_requested_;
}

// The worker goes; its sequences replay on the others. Steps in flight complete first, and a
// worker whose tokens wait for its scrubber vouches for them, so nothing sent is taken back.
void Scheduler::handleRetire() {
  drainSteps();
  if (slot_.worker() != nullptr && queues_.hasUnreleased())
    if (auto scrub = slot_.vouch()) applyScrub(*scrub, gated(*slot_.worker()));
  queues_.workerLost();
  const size_t held = queues_.waiting().size();
  handOff(/*may_park=*/false);
  const size_t left = queues_.waiting().size();
  if (left == 0) {
    spdlog::info("{} drained by an operator: {} sequences moved; stopping its worker",
                 links_.worker_name, held);
    slot_.shutdown();
    setServing(false);
  }
  if (left == 0 && links_.stopped_serving)
    links_.stopped_serving(unavailable("no worker can serve: every worker is drained or failing"));
  std::lock_guard lock(mu_);
  retire_requested_ = false;
  if (left != 0) {
    accepting_ = slot_.worker() != nullptr;
    retire_refused_ =
        failedPrecondition(links_.worker_name + " keeps serving: no other worker could take " +
                           std::to_string(left) + " of its sequences");
  } else {
    retired_ = true;
    retired_moved_ = uint32_t(held);
  }
  idle_.notify_all();
}

void Scheduler::handleRestart() {
  bool was_retired;
  {
    std::lock_guard lock(mu_);
    was_retired = retired_;
    retired_ = false;
  }
  if (was_retired) slot_.resume();
  const WorkerConnection* old = slot_.worker();
  const uint64_t old_incarnation = old ? old->hello().incarnation : 0;
  slot_.replace("operator", "restart requested by an operator", /*operator_request=*/true);
  // One start for the operator; if it fails, supervision retries as after any failure (with
  // backoff, and a crash loop if the starts keep failing), and the operator hears why.
  WorkerConnection* now = slot_.ensure();
  const std::string why = now == nullptr ? workerStatus().last_failure : std::string();
  std::lock_guard lock(mu_);
  restart_requested_ = false;
  restart_failed_.reset();
  if (now != nullptr) {
    last_restart_ = {old_incarnation, now->hello().incarnation};
  } else {
    restart_failed_ = unavailable("the worker was replaced, but the new one did not start (" + why +
                                  "); it is retried with backoff");
  }
  idle_.notify_all();
}

}  // namespace bulkhead
