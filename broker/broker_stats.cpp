// StatsBoard: several workers' boards combined into the broker's.
#include "broker/broker_stats.h"

namespace bulkhead {
namespace {

void addCounts(std::map<std::string, uint64_t>& into, const std::map<std::string, uint64_t>& from) {
  for (const auto& [key, n] : from) into[key] += n;
}

}  // namespace

SchedulerStats StatsBoard::combined(std::span<const StatsBoard* const> boards) {
  SchedulerStats out;
  std::vector<double> release, step, compute, sample, between, migration;
  for (const StatsBoard* b : boards) {
    std::lock_guard lock(b->mu_);
    const SchedulerStats& s = b->stats_;
    out.requests_received += s.requests_received;
    out.requests_completed += s.requests_completed;
    out.requests_failed += s.requests_failed;
    out.requests_rejected += s.requests_rejected;
    out.requests_running += s.requests_running;
    out.requests_waiting += s.requests_waiting;
    out.prompt_tokens += s.prompt_tokens;
    out.tokens_generated += s.tokens_generated;
    out.steps += s.steps;
    out.preemptions += s.preemptions;
    out.worker_restarts += s.worker_restarts;
    out.replayed_sequences += s.replayed_sequences;
    out.integrity_failures += s.integrity_failures;
    out.weight_corruptions += s.weight_corruptions;
    out.canary_runs += s.canary_runs;
    out.canary_failures += s.canary_failures;
    out.rolled_back_tokens += s.rolled_back_tokens;
    out.steps_overlapped += s.steps_overlapped;
    out.steps_discarded += s.steps_discarded;
    out.migrated_sequences += s.migrated_sequences;
    addCounts(out.restarts_by_cause, s.restarts_by_cause);
    addCounts(out.integrity_failures_by_check, s.integrity_failures_by_check);
    const Windows& w = b->windows_;
    for (auto [into, from] :
         {std::pair{&release, &w.release_ms}, std::pair{&step, &w.step_ms},
          std::pair{&compute, &w.compute_ms}, std::pair{&sample, &w.sample_ms},
          std::pair{&between, &w.between_ms}, std::pair{&migration, &w.migration_ms}})
      into->insert(into->end(), from->samples().begin(), from->samples().end());
  }
  out.release_latency_ms_p50 = LatencyWindow::percentileOf(release, 50);
  out.release_latency_ms_p99 = LatencyWindow::percentileOf(release, 99);
  out.step_ms_p50 = LatencyWindow::percentileOf(step, 50);
  out.compute_ms_p50 = LatencyWindow::percentileOf(compute, 50);
  out.sample_ms_p50 = LatencyWindow::percentileOf(sample, 50);
  out.between_steps_ms_p50 = LatencyWindow::percentileOf(between, 50);
  out.migration_ms_p50 = LatencyWindow::percentileOf(migration, 50);
  out.migration_ms_p99 = LatencyWindow::percentileOf(migration, 99);
  return out;
}

StatsHistograms StatsBoard::combinedHistograms(std::span<const StatsBoard* const> boards) {
  StatsHistograms out;
  for (const StatsBoard* b : boards) out.merge(b->histograms());
  return out;
}

}  // namespace bulkhead
