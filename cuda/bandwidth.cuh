// The device's memory read bandwidth as a kernel sees it, measured rather than taken from a data
// sheet: what bench-engine holds the decode step's weight reads against.
#pragma once

#include <cstddef>

#include "shared/status.h"

namespace bulkhead::cuda {

struct ReadBandwidth {
  double bytes_per_s = 0;  // the median of the timed passes
  size_t bytes = 0;        // read per pass
  int passes = 0;
};

// Reads `bytes` of device memory (far more than the L2 cache holds) with a streaming kernel,
// `passes` times after one untimed pass, each timed with events on the current device.
Result<ReadBandwidth> measureReadBandwidth(size_t bytes, int passes);

}  // namespace bulkhead::cuda
