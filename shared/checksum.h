// Checksums for weight granules and logits rows. Each 32-bit word is mixed with its index by a
// bijection (murmur3's finaliser) and the results are summed in 64 bits. The sum is
// order-independent, so a GPU reduction computes exactly the value the host loop does; a change
// to any single word changes the sum; and the loop vectorises, so verifying a row costs about a
// memory pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shared/mix.h"

namespace bulkhead {

constexpr size_t kChecksumGranuleBytes = size_t(2) << 20;

// Checksum of a byte range; a trailing partial word is zero-padded.
uint64_t checksumBytes(std::span<const std::byte> bytes);

// One checksum per `granule_bytes` (the last granule may be shorter).
std::vector<uint64_t> granuleChecksums(std::span<const std::byte> bytes,
                                       size_t granule_bytes = kChecksumGranuleBytes);

struct RowCheck {
  uint64_t checksum = 0;
  bool finite = true;  // no NaN or infinity
};

// checksumBytes over a float row and whether every value is finite, in one pass.
RowCheck checkRow(const float* row, size_t n);

}  // namespace bulkhead
