// The CUDA embedding, q/k/v (bias, RoPE, KV write) and SiLU-gate kernels: each row's result is the
// same whatever else shares the launch, the embedding and RoPE are bit-exact against the host (the
// same float operations as the CPU engine), and the activation is within one bf16 rounding of
// double.
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

TEST(ElementwiseGpu, QkvRotatesAsTheCpuEngineDoesAndFillsTheCache) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  // Qwen2.5-0.5B's attention: 14 query heads and 2 KV heads of 64, theta 1e6; rows at scattered
  // positions, each in a block of its own.
  ModelConfig config;
  config.head_dim = 64;
  config.rope.theta = 1e6;
  const int heads = 14, kv_heads = 2, head_dim = 64, half = head_dim / 2, max_context = 4096;
  const int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  const int stride = q_dim + 2 * kv_dim + 32, block_size = 16;
  const cuda::RopeTables tables = cuda::ropeTables(config.ropeInverseFrequencies(), max_context);
  const std::vector<uint32_t> positions = {0, 1, 17, 4095, 1000, 1};
  const std::vector<uint32_t> blocks = {3, 0, 5, 1, 2, 4};
  const int rows = int(positions.size());
  std::mt19937 rng{11};
  std::normal_distribution<float> value(0.0f, 2.0f);
  std::vector<float> x(size_t(rows) * stride);
  std::vector<__nv_bfloat16> bias[3] = {std::vector<__nv_bfloat16>(q_dim),
                                        std::vector<__nv_bfloat16>(kv_dim),
                                        std::vector<__nv_bfloat16>(kv_dim)};
  for (auto& v : x) v = value(rng);
  for (auto& b : bias)
    for (auto& v : b) v = __float2bfloat16(value(rng));
  DeviceBuffer<float> d_x(x), d_cos(tables.cos), d_sin(tables.sin);
  DeviceBuffer<__nv_bfloat16> d_qb(bias[0]), d_kb(bias[1]), d_vb(bias[2]);
  DeviceBuffer<uint32_t> d_pos(positions), d_blocks(blocks);
  const size_t cache_elems = size_t(6) * kv_heads * block_size * head_dim;
  DeviceBuffer<__nv_bfloat16> d_k(cache_elems), d_v(cache_elems);
  cuda::QkvArgs a;
  a.qkv = d_x.p;
  a.rows = rows;
  a.stride = stride;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  a.bias[0] = d_qb.p;
  a.bias[1] = d_kb.p;
  a.bias[2] = d_vb.p;
  a.positions = d_pos.p;
  a.cos_table = d_cos.p;
  a.sin_table = d_sin.p;
  a.k_cache = d_k.p;
  a.v_cache = d_v.p;
  a.row_block = d_blocks.p;
  a.block_size = block_size;
  ASSERT_TRUE(cuda::launchQkv(a, nullptr).ok());
  const std::vector<float> got = d_x.read();
  const std::vector<__nv_bfloat16> k_cache = d_k.read(), v_cache = d_v.read();
  auto cacheAt = [&](int r, int h, int i) {
    return ((size_t(blocks[size_t(r)]) * kv_heads + h) * block_size +
            positions[size_t(r)] % block_size) *
               head_dim +
           i;
  };
  auto bf = [](__nv_bfloat16 v) { return __bfloat162float(v); };
  for (int r = 0; r < rows; ++r) {
    const float* c = tables.cos.data() + size_t(positions[size_t(r)]) * half;
    const float* s = tables.sin.data() + size_t(positions[size_t(r)]) * half;
    for (int h = 0; h < heads + kv_heads; ++h) {
      const bool is_q = h < heads;
      for (int i = 0; i < half; ++i) {
        const size_t e = size_t(h) * head_dim + i;  // within q, then k
        const size_t at = size_t(r) * stride + e;
        const std::vector<__nv_bfloat16>& b = is_q ? bias[0] : bias[1];
        const size_t be = is_q ? e : e - q_dim;
        const float x0 = x[at] + bf(b[be]), x1 = x[at + half] + bf(b[be + half]);
        const float r0 = x0 * c[i] - x1 * s[i], r1 = x1 * c[i] + x0 * s[i];
        if (is_q) {
          ASSERT_EQ(got[at], r0) << "row " << r << " head " << h << " pair " << i;
          ASSERT_EQ(got[at + half], r1) << "row " << r << " head " << h << " pair " << i;
        } else {
          const size_t ce = cacheAt(r, h - heads, i);
          ASSERT_EQ(bf(k_cache[ce]), bf(__float2bfloat16(r0))) << "row " << r << " kv head " << h;
          ASSERT_EQ(bf(k_cache[ce + half]), bf(__float2bfloat16(r1)));
        }
      }
    }
    for (int e = 0; e < kv_dim; ++e) {
      const float v = x[size_t(r) * stride + q_dim + kv_dim + e] + bf(bias[2][size_t(e)]);
      ASSERT_EQ(bf(v_cache[cacheAt(r, e / head_dim, e % head_dim)]), bf(__float2bfloat16(v)))
          << "row " << r << " v " << e;
    }
    // The tail of each row beyond q, k and v is left alone.
    for (int i = q_dim + 2 * kv_dim; i < stride; ++i)
      ASSERT_EQ(got[size_t(r) * stride + i], x[size_t(r) * stride + i]);
  }
  a.stride = 10;
  EXPECT_FALSE(cuda::launchQkv(a, nullptr).ok());
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
