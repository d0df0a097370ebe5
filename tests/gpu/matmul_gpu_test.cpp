// The CUDA matmul is batch-invariant: every row of y is bit-identical whether it is computed
// alone or with up to 63 others, and in products of up to 2,048 rows (a prefill chunk), on the
// linear-layer, fused and lm_head shapes of the Qwen2.5 0.5B and 7B models; and it computes the
// product (against a double-precision host reference).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/matmul.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

struct Shape {
  int n, k;  // w is n x k: n outputs of k inputs
};

// Linear layers, the fused q/k/v and gate/up products, and lm_heads of both models (out x in).
const Shape kShapes[] = {{896, 896},    {128, 896},    {1152, 896},   {4864, 896},   {9728, 896},
                         {896, 4864},   {151936, 896}, {3584, 3584},  {512, 3584},   {4608, 3584},
                         {18944, 3584}, {37888, 3584}, {3584, 18944}, {152064, 3584}};
constexpr int kMaxRows = 64;
// Prefill-sized products: their first kMaxRows rows and their last, against the same rows
// computed with kMaxRows rows and alone.
const int kPrefillRows[] = {65, 96, 128, 257, 1024, 2048};
constexpr int kMostRows = 2048;

class MatmulGpuTest : public testing::TestWithParam<Shape> {};

TEST_P(MatmulGpuTest, RowsAreBitIdenticalForEveryRowCountAndMatchTheProduct) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [n, k] = GetParam();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto matmul = cuda::Matmul::create(stream);
  ASSERT_TRUE(matmul.ok()) << matmul.status().toString();

  std::mt19937 rng(uint32_t(n * 31 + k));
  std::uniform_real_distribution<float> weight(-0.05f, 0.05f), input(-1.0f, 1.0f);
  std::vector<__nv_bfloat16> w(size_t(n) * k), x(size_t(kMostRows) * k);
  for (auto& v : w) v = __float2bfloat16(weight(rng));
  for (auto& v : x) v = __float2bfloat16(input(rng));
  test::DeviceBuffer<__nv_bfloat16> dw(w.size()), dx(x.size());
  test::DeviceBuffer<float> dy(size_t(kMostRows) * n);
  ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);

  // The product of m rows from input row `first`; its rows [from, from + count) back.
  auto rowsOf = [&](int first, int m, int from, int count) {
    std::vector<float> y(size_t(count) * n);
    EXPECT_EQ(cudaMemsetAsync(dy.p, 0xff, size_t(m) * n * 4, stream), cudaSuccess);
    Status s = (*matmul)->run(dx.p + size_t(first) * k, m, dw.p, n, k, dy.p, false);
    EXPECT_TRUE(s.ok()) << s.toString();
    EXPECT_EQ(cudaMemcpyAsync(y.data(), dy.p + size_t(from) * n, y.size() * 4,
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return y;
  };
  auto product = [&](int m) { return rowsOf(0, m, 0, m); };
  const std::vector<float> all = product(kMaxRows);

  test::expectMatchesProduct(all, x, w, n, k, {0, kMaxRows / 2, kMaxRows - 1});

  // Every row count from 1 to 64 (the big shapes: a spread of them).
  const bool big = int64_t(n) * k > int64_t(20) << 20;
  for (int m = 1; m < kMaxRows; ++m) {
    if (big && m != 1 && m != 2 && m != 3 && m != 8 && m != 17 && m != 32 && m != 63) continue;
    const std::vector<float> part = product(m);
    for (int r = 0; r < m; ++r) {
      ASSERT_EQ(std::memcmp(part.data() + size_t(r) * n, all.data() + size_t(r) * n, size_t(n) * 4),
                0)
          << "row " << r << " of " << m << " differs from the same row of " << kMaxRows
          << " (shape " << n << "x" << k << ")";
    }
  }

  for (int m : kPrefillRows) {
    const std::vector<float> head = rowsOf(0, m, 0, kMaxRows), last = rowsOf(0, m, m - 1, 1);
    ASSERT_EQ(std::memcmp(head.data(), all.data(), head.size() * 4), 0)
        << "the first " << kMaxRows << " rows of " << m << " differ (shape " << n << "x" << k
        << ")";
    ASSERT_EQ(std::memcmp(last.data(), rowsOf(m - 1, 1, 0, 1).data(), last.size() * 4), 0)
        << "row " << m - 1 << " of " << m << " differs from that row alone (shape " << n << "x" << k
        << ")";
  }

  // Accumulating adds the product to what y holds, row by row the same.
  std::vector<float> twice(size_t(kMaxRows) * n);
  ASSERT_TRUE((*matmul)->run(dx.p, kMaxRows, dw.p, n, k, dy.p, false).ok());
  ASSERT_TRUE((*matmul)->run(dx.p, kMaxRows, dw.p, n, k, dy.p, true).ok());
  ASSERT_EQ(cudaMemcpy(twice.data(), dy.p, twice.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < twice.size(); i += 997) EXPECT_EQ(twice[i], all[i] + all[i]) << i;

  EXPECT_FALSE((*matmul)->run(dx.p, 0, dw.p, n, k, dy.p, false).ok());
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(ModelShapes, MatmulGpuTest, testing::ValuesIn(kShapes),
                         [](const testing::TestParamInfo<Shape>& i) {
                           return std::to_string(i.param.n) + "x" + std::to_string(i.param.k);
                         });

}  // namespace
}  // namespace bulkhead
