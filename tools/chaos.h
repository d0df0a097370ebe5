// `bulkhead chaos`: proves the broker's promise. Starts its own broker and workers with fault
// injection, records a fault-free reference for a set of greedy and seeded requests, then replays
// them under concurrent load while injecting faults from a seeded schedule, and checks that every
// completed output equals its reference and every fault was detected. With several workers the
// faults land on random workers, and a shorter run against a single-worker broker on the same
// machine (checked against the same references) gives the recovery times to compare with.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct ChaosOptions {
  std::string model_dir;
  std::string broker_path;  // default: next to the bulkhead executable
  std::string backend = "cpu";
  uint32_t faults = 100;
  uint64_t seed = 1;
  uint32_t concurrency = 8;
  uint32_t requests = 24;          // distinct requests in the reference set
  uint32_t step_timeout_ms = 300;  // the broker's base step deadline (hang detection)
  // The broker's --pipeline-sample-share; 0 sends two steps at once from the first (and the run
  // then fails if none was); unset: the broker's default.
  std::optional<double> pipeline_sample_share;
  uint32_t workers = 1;
  // With several workers: faults injected into the single-worker comparison run (the same
  // schedule's first ones; unset: as many as --faults; 0: no comparison run).
  std::optional<uint32_t> baseline_faults;
  std::vector<std::string> worker_args;  // extra worker flags, through the broker's --worker-arg
  std::string report_path;
};

// Prints the table; returns the process exit code (0 only if nothing was lost, mismatched,
// failed or undetected).
int runChaos(const ChaosOptions& options);

}  // namespace bulkhead
