// bench-gemm: a model's products alone, on the device: for each product of a decoder layer (fused
// q/k/v, o, fused gate/up, down) and the lm_head, at each row count, the time a launch takes and
// the weight bandwidth it reaches, for each schedule of our product (cuda/gemm.cuh: in use,
// pipelined, two tiles a warp; each with the fold of the weight words that the in-step checks
// add, and without) and for cuBLAS (workspace 0); then each schedule again with the k split over
// 1, 2, 4 and 8 blocks, whatever gemmSplits would choose. Launches cycle over enough copies of
// the weight that none is read from the L2 cache (weights too small for that are marked as timed
// from the cache), and run as a step runs them: back to back in one CUDA graph, programmatic
// where the device allows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct GemmBenchOptions {
  std::string shape = "qwen2.5-7b";  // a make-model shape
  std::vector<uint32_t> rows = {1, 8, 32, 64};
  // Timed launches per cell, in one graph; raised to the number of weight copies (up to 4,096)
  // where that is larger, so that every copy is read.
  uint32_t launches = 200;
  std::string json_path;
};

// Prints the table to stdout; writes JSON when asked.
Status runGemmBench(const GemmBenchOptions& options);

}  // namespace bulkhead
