// Weights reach the device through the two pinned staging buffers byte for byte, whatever the
// sizes of the pieces against the buffers'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>

#include "cuda/resources.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/staged_upload.h"

namespace bulkhead {
namespace {

TEST(StagedUploadGpu, EveryByteArrivesThroughBothBuffersManyTimes) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  // Tensors smaller than, equal to and several times larger than a 1 MiB stage, at odd sizes,
  // each to its own place in one device allocation with gaps between them.
  const size_t stage = size_t(1) << 20;
  const std::vector<size_t> sizes = {17, stage, 5 * stage + 3, 1, stage - 1, 3 * stage / 2, 4096};
  std::mt19937_64 rng(7);
  std::vector<std::vector<std::byte>> tensors;
  size_t device_bytes = 0;
  for (size_t n : sizes) {
    auto& t = tensors.emplace_back(n);
    for (auto& b : t) b = std::byte(rng());
    device_bytes += n + 256;
  }
  auto device = cuda::DeviceMemory::allocate(device_bytes);
  ASSERT_TRUE(device.ok()) << device.status().toString();
  ASSERT_EQ(cudaMemset(device->get(), 0xee, device_bytes), cudaSuccess);
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.ok());
  std::vector<Upload> uploads;
  std::vector<size_t> offsets;
  size_t at = 0;
  for (const auto& t : tensors) {
    uploads.push_back({t, device->get<std::byte>() + at});
    offsets.push_back(at);
    at += t.size() + 256;
  }
  const Status sent =
      uploadStaged(uploads, stream->get(), {.stage_bytes = stage, .piece_bytes = 64 << 10});
  ASSERT_TRUE(sent.ok()) << sent.toString();

  std::vector<std::byte> back(device_bytes);
  ASSERT_EQ(cudaMemcpy(back.data(), device->get(), device_bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::byte* got = back.data() + offsets[i];
    EXPECT_TRUE(std::equal(tensors[i].begin(), tensors[i].end(), got))
        << "tensor " << i << " of " << sizes[i] << " bytes arrived changed";
    for (size_t g = 0; g < 256; ++g)
      ASSERT_EQ(got[tensors[i].size() + g], std::byte{0xee})
          << "a copy wrote past tensor " << i << "'s end";
  }
}

}  // namespace
}  // namespace bulkhead
