// The broker's metrics for Prometheus: the counters, gauges and histograms of the workers'
// StatsBoards in the text exposition format, served over plain HTTP (cpp-httplib) at GET /metrics
// from a thread the server owns. Rendering reads one copy of each board per scrape; nothing on the
// serving path waits for a scrape.
#pragma once

#include <memory>
#include <string>

#include "broker/broker_stats.h"
#include "broker/router.h"
#include "shared/status.h"

namespace bulkhead {

// Prometheus text format (version 0.0.4). Durations in seconds. The broker's counters and
// histograms, and the per-worker gauges labelled worker="NAME".
std::string renderMetrics(const SchedulerStats& stats, const std::vector<WorkerView>& workers,
                          const StatsHistograms& histograms);

class MetricsServer {
 public:
  // Listens on host:port (port 0: a free one) and serves until destroyed.
  static Result<std::unique_ptr<MetricsServer>> start(const std::string& listen,
                                                      const Router& router);
  ~MetricsServer();  // stops the server and joins its thread
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  const std::string& address() const { return address_; }  // host:port bound

 private:
  MetricsServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace bulkhead
