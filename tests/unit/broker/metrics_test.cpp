// renderMetrics: every family declared once with its type, labelled counters escaped, histograms
// cumulative with +Inf equal to the count, durations in seconds; and several workers' boards
// combined into the broker's stats.
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <string>

#include "broker/metrics.h"

namespace bulkhead {
namespace {

// name{labels} -> value, and the declared type of each family.
struct Parsed {
  std::map<std::string, double> samples;
  std::map<std::string, std::string> types;
};

Parsed parse(const std::string& text) {
  Parsed p;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::string rest = line.substr(7);
      const std::string name = rest.substr(0, rest.find(' '));
      EXPECT_EQ(p.types.count(name), 0u) << name << " declared twice";
      p.types[name] = rest.substr(rest.find(' ') + 1);
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    EXPECT_NE(space, std::string::npos) << line;
    p.samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return p;
}

TEST(Metrics, RendersCountersLabelsAndCumulativeHistograms) {
  SchedulerStats s;
  s.requests_completed = 7;
  s.requests_failed = 1;
  s.tokens_generated = 90;
  s.prompt_tokens = 21;
  s.restarts_by_cause = {{"worker exited", 2}, {"odd \"cause\"", 1}};
  s.integrity_failures_by_check = {{"payload checksum", 3}};
  s.migrated_sequences = 4;
  std::vector<WorkerView> workers(2);
  workers[0].name = "worker-0";
  workers[0].status.state = "ready";
  workers[0].status.kv_blocks_total = 100;
  workers[0].status.kv_blocks_free = 60;
  workers[1].name = "worker-1";
  workers[1].status.state = "starting";
  workers[1].stats.requests_running = 3;
  StatsHistograms h;
  for (double ms : {0.1, 0.3, 3.0, 3.0, 70.0, 20000.0}) h.step_ms.add(ms);
  h.batch_size.add(3);

  const Parsed p = parse(renderMetrics(s, workers, h));
  EXPECT_EQ(p.types.at("bulkhead_requests_total"), "counter");
  EXPECT_EQ(p.samples.at("bulkhead_requests_total{outcome=\"completed\"}"), 7);
  EXPECT_EQ(p.samples.at("bulkhead_requests_total{outcome=\"failed\"}"), 1);
  EXPECT_EQ(p.samples.at("bulkhead_generated_tokens_total"), 90);
  EXPECT_EQ(p.samples.at("bulkhead_prompt_tokens_total"), 21);
  EXPECT_EQ(p.samples.at("bulkhead_worker_restarts_total{cause=\"worker exited\"}"), 2);
  EXPECT_EQ(p.samples.at("bulkhead_worker_restarts_total{cause=\"odd \\\"cause\\\"\"}"), 1);
  EXPECT_EQ(p.samples.at("bulkhead_integrity_failures_total{check=\"payload checksum\"}"), 3);
  EXPECT_EQ(p.samples.at("bulkhead_migrated_sequences_total"), 4);
  // One sample per worker, by name.
  EXPECT_EQ(p.types.at("bulkhead_worker_ready"), "gauge");
  EXPECT_EQ(p.samples.at("bulkhead_worker_ready{worker=\"worker-0\"}"), 1);
  EXPECT_EQ(p.samples.at("bulkhead_worker_ready{worker=\"worker-1\"}"), 0);
  EXPECT_EQ(p.samples.at("bulkhead_kv_blocks_free{worker=\"worker-0\"}"), 60);
  EXPECT_EQ(p.samples.at("bulkhead_worker_requests_running{worker=\"worker-1\"}"), 3);

  EXPECT_EQ(p.types.at("bulkhead_step_duration_seconds"), "histogram");
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"0.00025\"}"), 1);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"0.0005\"}"), 2);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"0.005\"}"), 4);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"0.1\"}"), 5);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"10\"}"), 5);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_bucket{le=\"+Inf\"}"), 6);
  EXPECT_EQ(p.samples.at("bulkhead_step_duration_seconds_count"), 6);
  EXPECT_NEAR(p.samples.at("bulkhead_step_duration_seconds_sum"), 20.0764, 1e-9);
  EXPECT_EQ(p.samples.at("bulkhead_step_batch_size_bucket{le=\"4\"}"), 1);
  EXPECT_EQ(p.samples.at("bulkhead_step_batch_size_bucket{le=\"2\"}"), 0);
}

// The broker's stats over several workers: counters and labelled counters added, percentiles
// over every worker's samples together, histograms merged.
TEST(StatsBoard, CombinedAddsCountersAndPoolsTheWindows) {
  StatsBoard a, b;
  a.update([](SchedulerStats& s, WorkerStatus&) {
    s.requests_completed = 3;
    s.migrated_sequences = 2;
    s.restarts_by_cause["worker exited"] = 1;
  });
  b.update([](SchedulerStats& s, WorkerStatus&) {
    s.requests_completed = 4;
    s.restarts_by_cause["worker exited"] = 2;
    s.restarts_by_cause["canary"] = 1;
  });
  for (double ms : {1.0, 2.0, 3.0}) a.addStepTimes(ms, ms, 0, 1);
  for (double ms : {10.0, 20.0, 30.0, 40.0, 50.0}) b.addStepTimes(ms, ms, 0, 2);
  b.addReleaseTimes({.after_step = {}, .first_token = {}, .inter_token = {}, .migration = {7.0}});
  const StatsBoard* boards[] = {&a, &b};
  const SchedulerStats s = StatsBoard::combined(boards);
  EXPECT_EQ(s.requests_completed, 7u);
  EXPECT_EQ(s.migrated_sequences, 2u);
  EXPECT_EQ(s.restarts_by_cause.at("worker exited"), 3u);
  EXPECT_EQ(s.restarts_by_cause.at("canary"), 1u);
  EXPECT_EQ(s.step_ms_p50, 20.0) << "the median of all eight steps, not of either board";
  EXPECT_EQ(s.migration_ms_p50, 7.0);
  const StatsHistograms h = StatsBoard::combinedHistograms(boards);
  EXPECT_EQ(h.step_ms.count(), 8u);
  EXPECT_EQ(h.migration_ms.count(), 1u);
  EXPECT_DOUBLE_EQ(h.batch_size.sum(), 3 * 1.0 + 5 * 2.0);
}

}  // namespace
}  // namespace bulkhead
