// Host implementation of the granule checksum (cuda/checksum.cu computes the same function).
#include "shared/checksum.h"

#include <cstring>

namespace bulkhead {

uint64_t granuleChecksum(std::span<const std::byte> bytes) {
  uint64_t sum = 0;
  const size_t words = bytes.size() / 4;
  for (size_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, bytes.data() + i * 4, 4);
    sum += checksumMix((uint64_t(w) << 32) | uint64_t(uint32_t(i)));
  }
  if (const size_t rest = bytes.size() % 4; rest != 0) {
    uint32_t w = 0;
    std::memcpy(&w, bytes.data() + words * 4, rest);
    sum += checksumMix((uint64_t(w) << 32) | uint64_t(uint32_t(words)));
  }
  return sum;
}

std::vector<uint64_t> granuleChecksums(std::span<const std::byte> bytes, size_t granule_bytes) {
  std::vector<uint64_t> sums;
  for (size_t offset = 0; offset < bytes.size(); offset += granule_bytes) {
    sums.push_back(
        granuleChecksum(bytes.subspan(offset, std::min(granule_bytes, bytes.size() - offset))));
  }
  return sums;
}

}  // namespace bulkhead
