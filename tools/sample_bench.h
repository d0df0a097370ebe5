// sample-bench: the broker's cost of verifying and sampling a step's logits rows, without a
// worker. Synthetic rows, near-flat (as random-weight models produce) or peaked (as trained models
// give: a few likely tokens above a spread of unlikely ones), timed per call for verify-only,
// greedy, temperature and temperature + top-p, for each pool size asked for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct SampleBenchOptions {
  uint32_t vocab = 152064;
  std::vector<uint32_t> rows = {1, 8, 32, 64};
  std::vector<unsigned> threads = {0};  // pool sizes, a table each; 0: hardware concurrency
  uint32_t iterations = 200;
  bool peaked = false;  // rows with a few likely tokens instead of near-flat ones
  // 16: the 16-lane (AVX-512) passes where the processor has them; 8: the 8-lane ones (the same
  // results; which is faster differs between processors).
  unsigned lanes = 16;
  std::string json_path;
};

// Prints the table to stdout; writes JSON when asked.
Status runSampleBench(const SampleBenchOptions& options);

}  // namespace bulkhead
