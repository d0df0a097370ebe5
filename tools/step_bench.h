// step-bench: the cost of a step beyond compute. Spawns a worker, runs decode steps at several
// batch sizes, and reports round trip minus the worker's own compute time: framing, socket,
// arena publish, and the broker's verification and (greedy) sampling of every row on its pool;
// then the round trip piece by piece, from the times the worker reports (StepTimeline).
#pragma once

#include <string>
#include <vector>

#include "broker/worker_client.h"
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
  unsigned sampling_threads = 0;  // 0: one per core, as the broker
  unsigned warm_spinners = 0;     // the broker's option: 0 by host (WorkPool::defaultSpinners)
  int64_t reply_spin_us = defaultReplySpin().count();  // WorkerClient::setReplySpin, as the broker
  bool in_step_checks = true;                          // the worker checks each step's weight reads
  std::vector<std::string> worker_args;                // passed on to the worker
  std::string json_path;
};

struct StepBenchRow {
  uint32_t batch = 0;
  double rtt_p50_us = 0, rtt_p99_us = 0, compute_p50_us = 0, overhead_p50_us = 0,
         overhead_p99_us = 0;
};

// Prints the table to stdout; writes JSON when asked.
Result<std::vector<StepBenchRow>> runStepBench(const StepBenchOptions& options);

// What the in-step checks cost: two workers, one with them and one without, given the same decode
// steps in alternation (so drift and neighbours on the host weigh on both alike). Prints each
// batch's compute p50 with and without, and the difference; writes JSON when asked.
Status runCheckCostBench(const StepBenchOptions& options);

}  // namespace bulkhead
