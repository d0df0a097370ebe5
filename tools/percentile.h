// Percentiles for the benchmark and chaos tables.
#pragma once

#include <algorithm>
#include <vector>

namespace bulkhead {

// The p-th percentile (0..100) by nearest rank; 0 for no samples.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p / 100.0 * double(v.size())))];
}

}  // namespace bulkhead
