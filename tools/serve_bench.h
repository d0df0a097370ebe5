// serve-bench: end-to-end tokens/s through a real broker against the worker's own compute ceiling,
// in one run. The ceiling at concurrency C is C / (the worker's compute time of a decode step at
// batch C), measured by step-bench first; then a fresh broker with default flags (one per row, so
// its latency windows hold that row alone) serves `bench` load at each concurrency, greedy and
// with temperature 0.8 + top-p 0.9, and the ratio is printed. Each row first sends untimed
// requests (warmup_requests_per_stream a stream), as step-bench and bench-engine take untimed
// steps first: a fresh worker's first steps of each size capture their CUDA graphs and load their
// kernels, which a serving worker has long done.
#pragma once

#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct ServeBenchOptions {
  std::string model_dir;
  std::string broker_path;  // default: next to this executable
  std::string worker_path;
  std::string backend = "cpu";
  std::vector<uint32_t> concurrency = {1, 32, 64};
  // Workers behind the broker, one broker per count and row; the ceiling is one worker's.
  std::vector<uint32_t> workers = {1};
  uint32_t prompt_len = 32;
  uint32_t gen_len = 128;
  uint32_t requests_per_stream = 4;
  uint32_t warmup_requests_per_stream = 1;  // untimed, before each row's timed requests
  std::vector<std::string> broker_args;     // extra flags for the broker (default: none)
  std::vector<std::string> worker_args;     // extra flags for every worker, the ceiling's included
  std::string json_path;
};

Status runServeBench(const ServeBenchOptions& options);

}  // namespace bulkhead
