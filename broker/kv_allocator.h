// KV-cache blocks as the broker hands them out: the worker owns the memory, the broker decides
// which sequence uses which block. LIFO free list, so allocation order is deterministic.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace bulkhead {

class KvBlockAllocator {
 public:
  explicit KvBlockAllocator(uint32_t count = 0) { reset(count); }

  // Forgets every allocation (a new worker incarnation has an empty cache). Blocks below
  // `reserved` are the worker's own (the canary's) and never handed out.
  void reset(uint32_t count, uint32_t reserved = 0) {
    total_ = count > reserved ? count - reserved : 0;
    free_.clear();
    for (uint32_t b = count; b > reserved; --b) free_.push_back(b - 1);
  }
  std::optional<uint32_t> allocate() {
    if (free_.empty()) return std::nullopt;
    const uint32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  void release(uint32_t block) { free_.push_back(block); }
  uint32_t freeCount() const { return uint32_t(free_.size()); }
  uint32_t total() const { return total_; }

 private:
  uint32_t total_ = 0;
  std::vector<uint32_t> free_;
};

}  // namespace bulkhead
