// A histogram with fixed bucket bounds, as Prometheus exposes one: a count per bucket, the total
// count and the sum. Cheap to add to (a short scan of the bounds), copied whole when read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace bulkhead {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void add(double v) {
    const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
    ++counts_[i];  // the last count is above every bound
    ++count_;
    sum_ += v;
  }
  const std::vector<double>& bounds() const { return bounds_; }
  // counts()[i]: values <= bounds()[i] and above the bound before; the last: above them all.
  const std::vector<uint64_t>& counts() const { return counts_; }
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  // Adds another histogram with the same bounds (the workers' histograms, for the broker's).
  void merge(const Histogram& other) {
    if (other.bounds_ != bounds_) return;
    for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
    count_ += other.count_;
    sum_ += other.sum_;
  }

  // Milliseconds, from a quarter of one to ten seconds.
  static Histogram latencyMs() {
    return Histogram({0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000});
  }
  // Sequences in a step.
  static Histogram batchSize() { return Histogram({1, 2, 4, 8, 16, 32, 64, 128, 256, 512}); }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ = 0;
};

}  // namespace bulkhead
