// StagingRing: see staging_ring.h.
#include "worker/staging_ring.h"

#include <string>

namespace bulkhead {

void StagingRing::copyNext(std::vector<Op>& ops) {
  const size_t j = next_copy_++;
  const auto slot = uint32_t(j % slots_);
  // Events are reused slot by slot: this wait is issued after the record of freed[slot] for unit
  // j - slots and before the next one, so it waits for that unit's products.
  if (j >= slots_) ops.push_back({Op::kCopyWaitsFreed, j, slot});
  ops.push_back({Op::kCopy, j, slot});
  ops.push_back({Op::kRecordStaged, j, slot});
}

std::vector<StagingRing::Op> StagingRing::begin() {
  next_copy_ = next_read_ = 0;
  reading_ = false;
  std::vector<Op> ops;
  while (next_copy_ < units_ && next_copy_ < slots_) copyNext(ops);
  return ops;
}

Result<std::vector<StagingRing::Op>> StagingRing::before(size_t unit) {
  if (reading_ || unit != next_read_ || unit >= units_)
    return failedPrecondition("streamed unit " + std::to_string(unit) + " read out of order (" +
                              std::to_string(next_read_) + " due of " + std::to_string(units_) +
                              ")");
  reading_ = true;
  return std::vector<Op>{{Op::kComputeWaits, unit, uint32_t(unit % slots_)}};
}

Result<std::vector<StagingRing::Op>> StagingRing::after(size_t unit) {
  if (!reading_ || unit != next_read_)
    return failedPrecondition("streamed unit " + std::to_string(unit) + " released before read");
  reading_ = false;
  ++next_read_;
  std::vector<Op> ops = {{Op::kRecordFreed, unit, uint32_t(unit % slots_)}};
  if (next_copy_ < units_) copyNext(ops);
  return ops;
}

Status StagingRing::end() const {
  if (reading_ || next_read_ != units_ || next_copy_ != units_)
    return internalError("a step read " + std::to_string(next_read_) + " and copied " +
                         std::to_string(next_copy_) + " of its " + std::to_string(units_) +
                         " streamed weight units");
  return okStatus();
}

}  // namespace bulkhead
