// The broker's metrics for Prometheus: the counters, gauges and histograms of the StatsBoard in
// the text exposition format, served over plain HTTP (cpp-httplib) at GET /metrics from a thread
// the server owns. Rendering reads one copy of the board per scrape; nothing on the serving path
// waits for a scrape.
#pragma once

#include <memory>
#include <string>

#include "broker/broker_stats.h"
#include "shared/status.h"

namespace bulkhead {

// Prometheus text format (version 0.0.4). Durations in seconds.
std::string renderMetrics(const SchedulerStats& stats, const WorkerStatus& worker,
                          const StatsHistograms& histograms);

class MetricsServer {
 public:
  // Listens on host:port (port 0: a free one) and serves until destroyed.
  static Result<std::unique_ptr<MetricsServer>> start(const std::string& listen,
                                                      const StatsBoard& board);
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
