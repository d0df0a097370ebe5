// The device checksum kernel computes exactly the host function, and sees a flipped bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>

#include "cuda/checksum.cuh"
#include "shared/checksum.h"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

TEST(GpuChecksum, MatchesHostAndDetectsBitFlip) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const size_t bytes = 5 * kChecksumGranuleBytes + 1234;
  std::vector<std::byte> host(bytes);
  std::mt19937_64 rng(42);
  for (auto& b : host) b = std::byte(rng());
  void* dev = nullptr;
  uint64_t* sums = nullptr;
  const size_t granules = (bytes + kChecksumGranuleBytes - 1) / kChecksumGranuleBytes;
  ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&sums, granules * 8), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);

  auto deviceSums = [&] {
    std::vector<uint64_t> out(granules);
    Status s = cuda::launchGranuleChecksums(dev, bytes, kChecksumGranuleBytes, sums, nullptr);
    EXPECT_TRUE(s.ok()) << s.toString();
    EXPECT_EQ(cudaMemcpy(out.data(), sums, granules * 8, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  };
  const auto expected = granuleChecksums(host);
  EXPECT_EQ(deviceSums(), expected);

  // Flip one bit on the device; only its granule's checksum changes.
  const size_t at = 3 * kChecksumGranuleBytes + 777;
  unsigned char flipped = static_cast<unsigned char>(host[at]) ^ 0x10;
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(dev) + at, &flipped, 1, cudaMemcpyHostToDevice),
            cudaSuccess);
  const auto after = deviceSums();
  for (size_t g = 0; g < granules; ++g) {
    if (g == 3) {
      EXPECT_NE(after[g], expected[g]);
    } else {
      EXPECT_EQ(after[g], expected[g]) << "granule " << g;
    }
  }
  cudaFree(dev);
  cudaFree(sums);
}

}  // namespace
}  // namespace bulkhead
