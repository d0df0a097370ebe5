// The CUDA embedding, bias + RoPE and SiLU-gate kernels: each row's result is the same whatever
// else shares the launch, the embedding and RoPE are bit-exact against the host (the same float
// operations as the CPU engine), and the activation is within one bf16 rounding of double.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/activation.cuh"
#include "cuda/embedding.cuh"
#include "cuda/rope.cuh"
#include "shared/model_config.h"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

using test::DeviceBuffer;

TEST(ElementwiseGpu, EmbeddingWidensTheTokensRowsExactly) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const int vocab = 1000, hidden = 896;
  std::mt19937 rng{7};
  std::normal_distribution<float> value(0.0f, 1.0f);
  std::vector<__nv_bfloat16> table(size_t(vocab) * hidden);
  for (auto& v : table) v = __float2bfloat16(value(rng));
  const std::vector<uint32_t> tokens = {0, 999, 5, 5, 123, 0, 998};
  DeviceBuffer<__nv_bfloat16> d_table(table);
  DeviceBuffer<uint32_t> d_tokens(tokens);
  DeviceBuffer<float> d_out(tokens.size() * hidden);
  ASSERT_TRUE(
      cuda::launchEmbedding(d_table.p, hidden, d_tokens.p, int(tokens.size()), d_out.p, nullptr)
          .ok());
  const std::vector<float> out = d_out.read();
  for (size_t r = 0; r < tokens.size(); ++r)
    for (int i = 0; i < hidden; ++i)
      ASSERT_EQ(out[r * hidden + i], __bfloat162float(table[size_t(tokens[r]) * hidden + i]))
          << "row " << r << ", " << i;
  EXPECT_FALSE(cuda::launchEmbedding(d_table.p, 0, d_tokens.p, 1, d_out.p, nullptr).ok());
}

TEST(ElementwiseGpu, BiasRopeRotatesAsTheCpuEngineDoes) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  // Qwen2.5-0.5B's query: 14 heads of 64, theta 1e6; rows at scattered positions.
  ModelConfig config;
  config.head_dim = 64;
  config.rope.theta = 1e6;
  const int heads = 14, head_dim = 64, stride = heads * head_dim + 32, max_context = 4096;
  const cuda::RopeTables tables = cuda::ropeTables(config.ropeInverseFrequencies(), max_context);
  const std::vector<uint32_t> positions = {0, 1, 17, 4095, 1000, 1};
  const int rows = int(positions.size());
  std::mt19937 rng{11};
  std::normal_distribution<float> value(0.0f, 2.0f);
  std::vector<float> x(size_t(rows) * stride), bias(size_t(heads) * head_dim);
  for (auto& v : x) v = value(rng);
  for (auto& v : bias) v = value(rng);
  DeviceBuffer<float> d_x(x), d_bias(bias), d_cos(tables.cos), d_sin(tables.sin);
  DeviceBuffer<uint32_t> d_pos(positions);
  ASSERT_TRUE(cuda::launchBiasRope(d_x.p, rows, stride, heads, head_dim, d_bias.p, d_pos.p, d_cos.p,
                                   d_sin.p, nullptr)
                  .ok());
  const std::vector<float> got = d_x.read();
  const int half = head_dim / 2;
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < half; ++i) {
        const size_t at = size_t(r) * stride + size_t(h) * head_dim + i;
        const float a = x[at] + bias[size_t(h) * head_dim + i];
        const float b = x[at + half] + bias[size_t(h) * head_dim + i + half];
        const float c = tables.cos[size_t(positions[size_t(r)]) * half + i];
        const float s = tables.sin[size_t(positions[size_t(r)]) * half + i];
        ASSERT_EQ(got[at], a * c - b * s) << "row " << r << " head " << h << " pair " << i;
        ASSERT_EQ(got[at + half], b * c + a * s) << "row " << r << " head " << h << " pair " << i;
      }
    }
    // The tail of each row beyond the heads is left alone.
    for (int i = heads * head_dim; i < stride; ++i)
      ASSERT_EQ(got[size_t(r) * stride + i], x[size_t(r) * stride + i]);
  }
  EXPECT_FALSE(cuda::launchBiasRope(d_x.p, 1, 10, heads, head_dim, nullptr, d_pos.p, d_cos.p,
                                    d_sin.p, nullptr)
                   .ok());
}

TEST(ElementwiseGpu, SiluMulIsWithinOneBf16RoundingAndRowIndependent) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const int rows = 33, inter = 4864;
  std::mt19937 rng{13};
  std::normal_distribution<float> value(0.0f, 3.0f);
  std::vector<float> gate_up(size_t(rows) * 2 * inter);
  for (auto& v : gate_up) v = value(rng);
  DeviceBuffer<float> d_in(gate_up);
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * inter), d_one{size_t(inter)};
  ASSERT_TRUE(cuda::launchSiluMul(d_in.p, rows, inter, d_out.p, nullptr).ok());
  const std::vector<__nv_bfloat16> out = d_out.read();
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const double g = gate_up[size_t(r) * 2 * inter + i];
      const double u = gate_up[size_t(r) * 2 * inter + inter + i];
      const double expect = g / (1.0 + std::exp(-g)) * u;
      ASSERT_NEAR(__bfloat162float(out[size_t(r) * inter + i]), expect,
                  std::fabs(expect) * 0x1p-8 + 1e-30)
          << "row " << r << ", " << i;
    }
  }
  // Row 20 alone gives the bits it got among 33.
  ASSERT_TRUE(
      cuda::launchSiluMul(d_in.p + size_t(20) * 2 * inter, 1, inter, d_one.p, nullptr).ok());
  const std::vector<__nv_bfloat16> alone = d_one.read();
  EXPECT_EQ(std::memcmp(alone.data(), out.data() + size_t(20) * inter, size_t(inter) * 2), 0);
}

}  // namespace
}  // namespace bulkhead
