// Counters and the worker's status as Admin reports them: written by the scheduler thread, read by
// RPC threads, behind one small lock that is never held while calling out.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "broker/histogram.h"
#include "broker/latency_window.h"
#include "broker/sequence.h"

namespace bulkhead {

struct SchedulerStats {
  uint64_t requests_received = 0, requests_completed = 0, requests_failed = 0,
           requests_rejected = 0;
  uint32_t requests_running = 0, requests_waiting = 0;
  uint64_t prompt_tokens = 0, tokens_generated = 0, steps = 0, preemptions = 0, worker_restarts = 0,
           replayed_sequences = 0, integrity_failures = 0, weight_corruptions = 0, canary_runs = 0,
           canary_failures = 0, rolled_back_tokens = 0;
  // Steps sent while another awaited its reply (two in flight: sampling hidden behind compute).
  uint64_t steps_overlapped = 0;
  // Steps whose rows were not used: in flight when an earlier step failed its integrity checks.
  uint64_t steps_discarded = 0;
  // Sequences this worker handed to the others when it was lost or drained, and, over the last
  // 4096 that moved here, the time from the loss to their first token on this worker.
  uint64_t migrated_sequences = 0;
  double migration_ms_p50 = 0, migration_ms_p99 = 0;
  // From the end of a token's step to its release; and the steps themselves (last 4096 each).
  double release_latency_ms_p50 = 0, release_latency_ms_p99 = 0, step_ms_p50 = 0;
  // Where a step's time goes: the worker's own compute (as it reports it), the broker's
  // verification and sampling of the step's rows, and the broker's time from one step's reply
  // to the next step's request when it went straight on (no wait for work in between).
  double compute_ms_p50 = 0, sample_ms_p50 = 0, between_steps_ms_p50 = 0;
  // Worker replacements by what caused them, and failed integrity checks by check.
  std::map<std::string, uint64_t> restarts_by_cause, integrity_failures_by_check;
};

// Since the broker started, for the metrics endpoint.
struct StatsHistograms {
  Histogram step_ms = Histogram::latencyMs();         // a step's round trip
  Histogram release_ms = Histogram::latencyMs();      // a token's step end to its release
  Histogram first_token_ms = Histogram::latencyMs();  // request arrival to its first token
  Histogram inter_token_ms = Histogram::latencyMs();  // between a sequence's token releases
  Histogram batch_size = Histogram::batchSize();      // sequences in a step
  Histogram migration_ms = Histogram::latencyMs();    // worker lost to first token elsewhere

  void merge(const StatsHistograms& o) {
    step_ms.merge(o.step_ms);
    release_ms.merge(o.release_ms);
    first_token_ms.merge(o.first_token_ms);
    inter_token_ms.merge(o.inter_token_ms);
    batch_size.merge(o.batch_size);
    migration_ms.merge(o.migration_ms);
  }
};

struct WorkerStatus {
  std::string state = "starting";  // starting | ready | failed | stopped
  uint64_t incarnation = 0;
  int pid = 0;
  std::string backend;
  uint32_t kv_blocks_total = 0, kv_blocks_free = 0;
  uint32_t kv_block_size = 0;          // positions a block; 0 until a worker was ready
  uint64_t weight_bytes = 0;           // resident in the worker's memory
  uint64_t streamed_weight_bytes = 0;  // in host memory, copied to the device every step
  // Scrub progress: the newest step the worker computed, and the newest its scrubber has
  // verified every resident weight after.
  uint64_t last_step = 0, scrub_clean_through = 0;
  uint32_t restarts = 0;
  std::string last_failure;

  // Whether the worker's KV cache, the canary's blocks aside, can hold a sequence of `positions`
  // (true while its size is unknown: the sequence's own admission decides then).
  bool holds(uint64_t positions) const {
    return kv_block_size == 0 || positions <= uint64_t(kv_blocks_total) * kv_block_size;
  }
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
    const StatsBoard* self = this;
    return combined(std::span(&self, 1));
  }
  // Several workers' boards as one: counters added, percentiles over their windows together.
  static SchedulerStats combined(std::span<const StatsBoard* const> boards);
  static StatsHistograms combinedHistograms(std::span<const StatsBoard* const> boards);
  void addReleaseTimes(const ReleaseTimes& times) {
    std::lock_guard lock(mu_);
    for (double v : times.after_step) {
      windows_.release_ms.add(v);
      histograms_.release_ms.add(v);
    }
    for (double v : times.first_token) histograms_.first_token_ms.add(v);
    for (double v : times.inter_token) histograms_.inter_token_ms.add(v);
    for (double v : times.migration) {
      windows_.migration_ms.add(v);
      histograms_.migration_ms.add(v);
    }
  }
  // A completed step: its round trip, the worker's compute, the broker's sampling, and how many
  // sequences it carried.
  void addStepTimes(double step_ms, double compute_ms, double sample_ms, size_t batch) {
    std::lock_guard lock(mu_);
    windows_.step_ms.add(step_ms);
    windows_.compute_ms.add(compute_ms);
    windows_.sample_ms.add(sample_ms);
    histograms_.step_ms.add(step_ms);
    histograms_.batch_size.add(double(batch));
  }
  StatsHistograms histograms() const {
    std::lock_guard lock(mu_);
    return histograms_;
  }
  void addBetweenSteps(double ms) {
    std::lock_guard lock(mu_);
    windows_.between_ms.add(ms);
  }
  WorkerStatus worker() const {
    std::lock_guard lock(mu_);
    return worker_;
  }

 private:
  mutable std::mutex mu_;
  SchedulerStats stats_;
  WorkerStatus worker_;
  struct Windows {
    LatencyWindow release_ms, step_ms, compute_ms, sample_ms, between_ms, migration_ms;
  };
  Windows windows_;
  StatsHistograms histograms_;
};

}  // namespace bulkhead
