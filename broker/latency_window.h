// The last N samples of a latency, for percentiles in Admin stats: a ring buffer, sorted only when
// someone asks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace bulkhead {

class LatencyWindow {
 public:
  explicit LatencyWindow(size_t capacity = 4096) : capacity_(capacity) {}

  void add(double value) {
    if (samples_.size() < capacity_) {
      samples_.push_back(value);
    } else {
      samples_[next_] = value;
    }
    next_ = (next_ + 1) % capacity_;
  }
  // The p-th percentile (nearest rank) of the samples held; 0 when there are none.
  double percentile(double p) const { return percentileOf(samples_, p); }
  // The samples held, in no particular order.
  const std::vector<double>& samples() const { return samples_; }
  static double percentileOf(std::vector<double> values, double p) {
    if (values.empty()) return 0;
    const size_t rank = std::min(values.size() - 1, size_t(p / 100.0 * double(values.size())));
    std::nth_element(values.begin(), values.begin() + long(rank), values.end());
    return values[rank];
  }

 private:
  size_t capacity_;
  std::vector<double> samples_;
  size_t next_ = 0;
};

}  // namespace bulkhead
