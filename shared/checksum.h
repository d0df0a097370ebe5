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

class WorkPool;
// granuleChecksums of several byte ranges, one after another in one vector, the granules spread
// over `pool` (a worker's start checksums every weight byte: gigabytes for a large model).
std::vector<uint64_t> granuleChecksums(std::span<const std::span<const std::byte>> ranges,
                                       size_t granule_bytes, WorkPool& pool);

// In-step weight verification: the terms (mix.h foldWordTerm) of one weight row's 32-bit words
// as a kernel reads them, keyed by a salt that names the weight's role (so the right bytes read in
// the wrong role do not match) and by each word's index within the weight, `first_index` for the
// row's first word. A trailing partial word is zero-padded. Rows are summed, so the order they are
// read in does not matter.
uint64_t foldWeightRow(const std::byte* row, size_t bytes, uint64_t first_index, uint32_t salt);
// Words per row as foldWeightRow counts them.
inline uint64_t weightRowWords(size_t bytes) {
  return (bytes + 3) / 4;
}

struct RowCheck {
  uint64_t checksum = 0;
  bool finite = true;  // no NaN or infinity
};

// checksumBytes over a float row and whether every value is finite, in one pass.
RowCheck checkRow(const float* row, size_t n);

}  // namespace bulkhead
