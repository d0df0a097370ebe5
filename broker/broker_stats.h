// Counters and the worker's status as Admin reports them: written by the scheduler thread, read by
// RPC threads, behind one small lock that is never held while calling out.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "broker/latency_window.h"

namespace bulkhead {

struct SchedulerStats {
  uint64_t requests_received = 0, requests_completed = 0, requests_failed = 0,
           requests_rejected = 0;
  uint32_t requests_running = 0, requests_waiting = 0;
  uint64_t tokens_generated = 0, steps = 0, preemptions = 0, worker_restarts = 0,
           replayed_sequences = 0, integrity_failures = 0, weight_corruptions = 0, canary_runs = 0,
           canary_failures = 0, rolled_back_tokens = 0;
  // From the end of a token's step to its release; and the steps themselves (last 4096 each).
  double release_latency_ms_p50 = 0, release_latency_ms_p99 = 0, step_ms_p50 = 0;
  // Where a step's time goes: the worker's own compute (as it reports it), the broker's
  // verification and sampling of the step's rows, and the broker's time from one step's reply
  // to the next step's request when it went straight on (no wait for work in between).
  double compute_ms_p50 = 0, sample_ms_p50 = 0, between_steps_ms_p50 = 0;
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

class StatsBoard {
 public:
  // Runs `change(stats, worker)` under the lock.
  template <typename F>
  void update(F&& change) {
    std::lock_guard lock(mu_);
    change(stats_, worker_);
  }
  // The counters; the latency percentiles stay 0 (see withLatencies: they cost a sort).
  SchedulerStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }
  // The counters and the latency percentiles, for Admin.
  SchedulerStats withLatencies() const {
    std::lock_guard lock(mu_);
    SchedulerStats out = stats_;
    out.release_latency_ms_p50 = release_ms_.percentile(50);
    out.release_latency_ms_p99 = release_ms_.percentile(99);
    out.step_ms_p50 = step_ms_.percentile(50);
    out.compute_ms_p50 = compute_ms_.percentile(50);
    out.sample_ms_p50 = sample_ms_.percentile(50);
    out.between_steps_ms_p50 = between_ms_.percentile(50);
    return out;
  }
  void addReleaseLatencies(const std::vector<double>& ms) {
    std::lock_guard lock(mu_);
    for (double v : ms) release_ms_.add(v);
  }
  // A completed step: its round trip, the worker's compute and the broker's sampling.
  void addStepTimes(double step_ms, double compute_ms, double sample_ms) {
    std::lock_guard lock(mu_);
    step_ms_.add(step_ms);
    compute_ms_.add(compute_ms);
    sample_ms_.add(sample_ms);
  }
  void addBetweenSteps(double ms) {
    std::lock_guard lock(mu_);
    between_ms_.add(ms);
  }
  WorkerStatus worker() const {
    std::lock_guard lock(mu_);
    return worker_;
  }

 private:
  mutable std::mutex mu_;
  SchedulerStats stats_;
  WorkerStatus worker_;
  LatencyWindow release_ms_, step_ms_, compute_ms_, sample_ms_, between_ms_;
};

}  // namespace bulkhead
