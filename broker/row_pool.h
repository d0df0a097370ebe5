// TEMPORARY
#pragma once
#include <cstddef>
#include <functional>
namespace bulkhead {
class RowPool {
 public:
  explicit RowPool(unsigned threads = 0) {}
  unsigned threads() const { return 1; }
  void parallelFor(size_t n, const std::function<void(size_t)>& fn) {
    for (size_t i = 0; i < n; ++i) fn(i);
  }
};
}  // namespace bulkhead
