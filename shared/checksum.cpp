// Host implementation of the checksums (cuda/checksum.cu computes the same function).
#include "shared/checksum.h"

#include <algorithm>
#include <cstring>

#include "shared/work_pool.h"

namespace bulkhead {
namespace {

uint64_t wordsChecksum(const std::byte* data, size_t words) {
  uint64_t sum = 0;
  for (size_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, data + i * 4, 4);
    sum += checksumTerm(w, uint32_t(i));
  }
  return sum;
}

}  // namespace

uint64_t checksumBytes(std::span<const std::byte> bytes) {
  const size_t words = bytes.size() / 4;
  uint64_t sum = wordsChecksum(bytes.data(), words);
  if (const size_t rest = bytes.size() % 4; rest != 0) {
    uint32_t w = 0;
    std::memcpy(&w, bytes.data() + words * 4, rest);
    sum += checksumTerm(w, uint32_t(words));
  }
  return sum;
}

std::vector<uint64_t> granuleChecksums(std::span<const std::byte> bytes, size_t granule_bytes) {
  std::vector<uint64_t> sums;
  for (size_t offset = 0; offset < bytes.size(); offset += granule_bytes) {
    sums.push_back(
        checksumBytes(bytes.subspan(offset, std::min(granule_bytes, bytes.size() - offset))));
  }
  return sums;
}

std::vector<uint64_t> granuleChecksums(std::span<const std::span<const std::byte>> ranges,
                                       size_t granule_bytes, WorkPool& pool) {
  std::vector<std::span<const std::byte>> granules;
  for (std::span<const std::byte> bytes : ranges)
    for (size_t offset = 0; offset < bytes.size(); offset += granule_bytes)
      granules.push_back(bytes.subspan(offset, std::min(granule_bytes, bytes.size() - offset)));
  std::vector<uint64_t> sums(granules.size());
  pool.parallelFor(granules.size(), [&](size_t i) { sums[i] = checksumBytes(granules[i]); });
  return sums;
}

uint64_t foldWeightRow(const std::byte* row, size_t bytes, uint64_t first_index, uint32_t salt) {
  const size_t words = bytes / 4;
  uint64_t sum = 0;
  for (size_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, row + i * 4, 4);
    sum += foldWordTerm(w, salt, uint32_t(first_index + i));
  }
  if (const size_t rest = bytes % 4; rest != 0) {
    uint32_t w = 0;
    std::memcpy(&w, row + words * 4, rest);
    sum += foldWordTerm(w, salt, uint32_t(first_index + words));
  }
  return sum;
}

RowCheck checkRow(const float* row, size_t n) {
  uint64_t sum = 0;
  uint32_t non_finite = 0;
  const auto* data = reinterpret_cast<const std::byte*>(row);
  for (size_t i = 0; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, data + i * 4, 4);
    sum += checksumTerm(w, uint32_t(i));
    non_finite |= uint32_t((w & 0x7f800000u) == 0x7f800000u);
  }
  return {sum, non_finite == 0};
}

}  // namespace bulkhead
