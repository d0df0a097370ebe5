// Our tensor-core product: every row of y is bit-identical whatever the number of rows (1 to 64,
// and prefill sizes past one tile), on the products of the Qwen2.5 0.5B and 7B models (fused
// q/k/v and gate/up included) and on ragged shapes; it computes the product (against double
// precision) and agrees with cuBLAS, its reference, to fp32 accumulation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemm.cuh"
#include "cuda/matmul.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

struct Shape {
  int n, k;  // w is n x k: n outputs of k inputs
};

const Shape kShapes[] = {{896, 896},    {1152, 896},    {9728, 896},  {896, 4864},
                         {151936, 896}, {4608, 3584},   {3584, 3584}, {37888, 3584},
                         {3584, 18944}, {152064, 3584}, {128, 64},    {352, 64},
                         {64, 176},     {10, 24},       {33, 40},     {100, 4008}};
constexpr int kMaxRows = 200;

class GemmGpuTest : public testing::TestWithParam<Shape> {};

TEST_P(GemmGpuTest, RowsAreBitIdenticalForEveryRowCountAndMatchTheProduct) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [n, k] = GetParam();
  std::mt19937 rng{uint32_t(n * 31 + k)};
  std::normal_distribution<float> weight(0.0f, 0.05f), input(0.0f, 1.0f);
  std::vector<__nv_bfloat16> w(size_t(n) * k), x(size_t(kMaxRows) * k);
  for (auto& v : w) v = __float2bfloat16(weight(rng));
  for (auto& v : x) v = __float2bfloat16(input(rng));
  test::DeviceBuffer<__nv_bfloat16> dw(w), dx(x);
  test::DeviceBuffer<float> dy(size_t(kMaxRows) * n);
  auto product = [&](int m) {
    EXPECT_EQ(cudaMemset(dy.p, 0xff, size_t(kMaxRows) * n * 4), cudaSuccess);
    const Status s = cuda::launchGemm(dx.p, m, dw.p, n, k, dy.p, n, nullptr);
    EXPECT_TRUE(s.ok()) << s.toString();
    return dy.read(0, size_t(m) * n);
  };
  const std::vector<float> all = product(kMaxRows);

  test::expectMatchesProduct(all, x, w, n, k, {0, 63, 64, kMaxRows - 1});

  // Every row count from 1 to 64, then prefill sizes (the big shapes: a spread of them).
  const bool big = int64_t(n) * k > int64_t(20) << 20;
  std::vector<int> counts;
  for (int m = 1; m <= 64; ++m)
    if (!big || m <= 3 || m == 8 || m == 9 || m == 17 || m == 33 || m == 64) counts.push_back(m);
  for (int m : {65, 130}) counts.push_back(m);
  for (int m : counts) {
    const std::vector<float> part = product(m);
    for (int r = 0; r < m; ++r)
      ASSERT_EQ(std::memcmp(part.data() + size_t(r) * n, all.data() + size_t(r) * n, size_t(n) * 4),
                0)
          << "row " << r << " of " << m << " differs from the same row of " << kMaxRows
          << " (shape " << n << "x" << k << ")";
  }

  // cuBLAS (no workspace), the reference: the same sums in another order.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    auto cublas = cuda::Matmul::create(stream);
    ASSERT_TRUE(cublas.ok()) << cublas.status().toString();
    ASSERT_TRUE((*cublas)->run(dx.p, kMaxRows, dw.p, n, k, dy.p, false).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  const std::vector<float> reference = dy.read(0, size_t(kMaxRows) * n);
  double worst = 0;
  for (size_t i = 0; i < all.size(); ++i)
    worst = std::max(worst, double(std::fabs(all[i] - reference[i])));
  EXPECT_LE(worst, 1e-3) << "largest difference from cuBLAS";
  RecordProperty("max_abs_difference_from_cublas", std::to_string(worst));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  EXPECT_FALSE(cuda::launchGemm(dx.p, 0, dw.p, n, k, dy.p, n, nullptr).ok());
  EXPECT_FALSE(cuda::launchGemm(dx.p, 1, dw.p, n, k + 1, dy.p, n, nullptr).ok());
}

INSTANTIATE_TEST_SUITE_P(ModelShapes, GemmGpuTest, testing::ValuesIn(kShapes),
                         [](const testing::TestParamInfo<Shape>& i) {
                           return std::to_string(i.param.n) + "x" + std::to_string(i.param.k);
                         });

}  // namespace
}  // namespace bulkhead
