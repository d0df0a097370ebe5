// step-bench: the cost of a step beyond compute. Spawns a worker, runs decode steps at several
// batch sizes, and reports round trip minus the worker's own compute time: framing, socket,
// arena publish and the broker's row verification.
#pragma once

#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct StepBenchOptions {
  std::string model_dir;
  std::string worker_path;
  std::string backend = "cpu";
  std::vector<uint32_t> batches = {1, 32};
  uint32_t iterations = 200;
  // The worker's background weight scrubbing (its share of one core); it competes with compute.
  double scrub_share = 0.0;
  std::string json_path;
};

// Prints the table to stdout; writes JSON when asked.
Status runStepBench(const StepBenchOptions& options);

}  // namespace bulkhead
