// Weight-granule checksums. The function is a wrapping sum of a bijective 64-bit mix of each
// 32-bit word with its index, so it is order-independent (a GPU reduction computes exactly the
// same value as the host loop) and any change to a single word changes the sum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace bulkhead {

constexpr size_t kChecksumGranuleBytes = size_t(2) << 20;

// splitmix64's finaliser: a bijection on 64-bit values.
constexpr uint64_t checksumMix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Checksum of one granule; a trailing partial word is zero-padded.
uint64_t granuleChecksum(std::span<const std::byte> bytes);

// One checksum per `granule_bytes` (the last granule may be shorter).
std::vector<uint64_t> granuleChecksums(std::span<const std::byte> bytes,
                                       size_t granule_bytes = kChecksumGranuleBytes);

}  // namespace bulkhead
