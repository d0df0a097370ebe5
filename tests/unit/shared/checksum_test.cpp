// Granule checksums: every single-bit flip is detected; granules split as documented.
#include "shared/checksum.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>

namespace bulkhead {
namespace {

TEST(Checksum, EveryBitFlipChangesTheSum) {
  std::vector<std::byte> data(4099);
  std::mt19937 rng(1);
  for (auto& b : data) b = std::byte(rng());
  const uint64_t clean = checksumBytes(data);
  for (size_t byte = 0; byte < data.size(); byte += 37) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= std::byte(1 << bit);
      EXPECT_NE(checksumBytes(data), clean) << "byte " << byte << " bit " << bit;
      data[byte] ^= std::byte(1 << bit);
    }
  }
  EXPECT_EQ(checksumBytes(data), clean);
}

TEST(Checksum, SwappedWordsAreDetected) {
  std::vector<std::byte> data(64);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i);
  const uint64_t clean = checksumBytes(data);
  std::swap_ranges(data.begin(), data.begin() + 4, data.begin() + 8);
  EXPECT_NE(checksumBytes(data), clean);
}

// The in-step fold: every single flip, and every pair of flips in different words, changes a
// weight row's fold; the same bytes under another salt, or moved to other indices, do not match.
TEST(Checksum, WeightFoldSeesEveryFlipAndPairOfFlips) {
  std::vector<std::byte> row(4 * 96);
  std::mt19937 rng(2);
  for (auto& b : row) b = std::byte(rng());
  const uint64_t first = 123456789, clean = foldWeightRow(row.data(), row.size(), first, 0xabcd);
  for (size_t bit = 0; bit < 8 * row.size(); ++bit) {
    row[bit / 8] ^= std::byte(1 << (bit % 8));
    EXPECT_NE(foldWeightRow(row.data(), row.size(), first, 0xabcd), clean) << "bit " << bit;
    for (size_t other = (bit / 32 + 1) * 32; other < 8 * row.size(); other += 29) {
      row[other / 8] ^= std::byte(1 << (other % 8));
      EXPECT_NE(foldWeightRow(row.data(), row.size(), first, 0xabcd), clean)
          << "bits " << bit << " and " << other;
      row[other / 8] ^= std::byte(1 << (other % 8));
    }
    row[bit / 8] ^= std::byte(1 << (bit % 8));
  }
  EXPECT_EQ(foldWeightRow(row.data(), row.size(), first, 0xabcd), clean);
  EXPECT_NE(foldWeightRow(row.data(), row.size(), first, 0xabce), clean);
  EXPECT_NE(foldWeightRow(row.data(), row.size(), first + 96, 0xabcd), clean);
}

TEST(Checksum, GranulesSplitTheBuffer) {
  std::vector<std::byte> data(10 * 1024 + 6, std::byte{7});
  const auto sums = granuleChecksums(data, 4096);
  ASSERT_EQ(sums.size(), 3u);
  EXPECT_EQ(sums[0], checksumBytes(std::span(data).subspan(0, 4096)));
  EXPECT_EQ(sums[2], checksumBytes(std::span(data).subspan(8192)));
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

TEST(Checksum, RowCheckMatchesBytesAndSeesNonFinite) {
  std::vector<float> row(1000);
  for (size_t i = 0; i < row.size(); ++i) row[i] = float(i) * 0.25f - 3.0f;
  RowCheck clean = checkRow(row.data(), row.size());
  EXPECT_TRUE(clean.finite);
  EXPECT_EQ(clean.checksum, checksumBytes(std::as_bytes(std::span(row))));
  row[500] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(checkRow(row.data(), row.size()).finite);
  row[500] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(checkRow(row.data(), row.size()).finite);
  row[500] = std::numeric_limits<float>::max();
  EXPECT_TRUE(checkRow(row.data(), row.size()).finite);
}

}  // namespace
}  // namespace bulkhead
