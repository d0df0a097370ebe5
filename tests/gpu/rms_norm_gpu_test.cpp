// The CUDA RMSNorm: a row's output is bit-identical however many rows share the launch, and it
// is the norm (against a double-precision host reference, within one bf16 rounding).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/rms_norm.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

class RmsNormGpuTest : public testing::TestWithParam<int> {};

TEST_P(RmsNormGpuTest, RowsAreIndependentOfTheLaunchAndNormalised) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const int hidden = GetParam(), rows = 64;
  const float eps = 1e-6f;
  std::mt19937 rng{uint32_t(hidden)};
  std::normal_distribution<float> value(0.0f, 3.0f);
  std::vector<float> x(size_t(rows) * hidden);
  std::vector<__nv_bfloat16> w(static_cast<size_t>(hidden));
  for (auto& v : x) v = value(rng);
  for (auto& v : w) v = __float2bfloat16(1.0f + 0.1f * value(rng));
  float* dx = nullptr;
  __nv_bfloat16 *dw = nullptr, *dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, w.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);

  auto norm = [&](int first, int count) {
    std::vector<__nv_bfloat16> out(size_t(count) * hidden);
    Status s = cuda::launchRmsNorm(dx + size_t(first) * hidden, count, hidden, dw, eps,
                                   dout + size_t(first) * hidden, nullptr);
    EXPECT_TRUE(s.ok()) << s.toString();
    EXPECT_EQ(cudaMemcpy(out.data(), dout + size_t(first) * hidden, out.size() * 2,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  };
  const auto all = norm(0, rows);
  for (int r = 0; r < rows; ++r) {
    double mean_square = 0;
    for (int i = 0; i < hidden; ++i)
      mean_square += double(x[size_t(r) * hidden + i]) * x[size_t(r) * hidden + i];
    const double inv = 1.0 / std::sqrt(mean_square / hidden + eps);
    for (int i = 0; i < hidden; i += 7) {
      const double expect =
          double(__bfloat162float(w[size_t(i)])) * x[size_t(r) * hidden + i] * inv;
      const double got = __bfloat162float(all[size_t(r) * hidden + i]);
      ASSERT_NEAR(got, expect, std::fabs(expect) * 0x1p-8 + 1e-6) << "row " << r << ", " << i;
    }
  }
  for (int r : {0, 5, 63}) {
    const auto alone = norm(r, 1);
    EXPECT_EQ(std::memcmp(alone.data(), all.data() + size_t(r) * hidden, size_t(hidden) * 2), 0)
        << "row " << r << " alone differs from the same row among " << rows;
  }
  EXPECT_FALSE(cuda::launchRmsNorm(dx, 1, 0, dw, eps, dout, nullptr).ok());
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dout);
}

INSTANTIATE_TEST_SUITE_P(HiddenSizes, RmsNormGpuTest, testing::Values(64, 896, 3584, 1000));

}  // namespace
}  // namespace bulkhead
