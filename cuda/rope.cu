// Bias + RoPE: one thread per (row, head, pair).
#include "cuda/rope.cuh"

#include <cmath>
#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    biasRopeKernel(float* __restrict__ x, int rows, int row_stride, int heads, int head_dim,
                   const float* __restrict__ bias, const uint32_t* __restrict__ positions,
                   const float* __restrict__ cos_table, const float* __restrict__ sin_table) {
  const int half = head_dim / 2;
  const int64_t index = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t per_row = int64_t(heads) * half;
  if (index >= per_row * rows) return;
  const int r = int(index / per_row), h = int(index % per_row / half), i = int(index % half);
  float* v = x + int64_t(r) * row_stride + int64_t(h) * head_dim;
  float a = v[i], b = v[i + half];
  if (bias != nullptr) {
    a += bias[h * head_dim + i];
    b += bias[h * head_dim + i + half];
  }
  const int64_t t = int64_t(positions[r]) * half + i;
  const float c = cos_table[t], s = sin_table[t];
  // As the CPU engine computes it: two rounded multiplies, then one rounded subtraction or
  // addition (the _rn intrinsics are never contracted into fused multiply-adds).
  v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

}  // namespace

RopeTables ropeTables(const std::vector<float>& inv_freq, uint32_t max_context) {
  const size_t pairs = inv_freq.size();
  RopeTables t{std::vector<float>(pairs * max_context), std::vector<float>(pairs * max_context)};
  for (uint32_t p = 0; p < max_context; ++p) {
    for (size_t i = 0; i < pairs; ++i) {
      const float angle = float(p) * inv_freq[i];
      t.cos[p * pairs + i] = std::cos(angle);
      t.sin[p * pairs + i] = std::sin(angle);
    }
  }
  return t;
}

Status launchBiasRope(float* x, int rows, int row_stride, int heads, int head_dim,
                      const float* bias, const uint32_t* positions, const float* cos_table,
                      const float* sin_table, cudaStream_t stream) {
  if (rows < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
      int64_t(heads) * head_dim > row_stride)
    return invalidArgument("rope over " + std::to_string(heads) + " heads of " +
                           std::to_string(head_dim) + " in rows of " + std::to_string(row_stride));
  if (rows == 0) return okStatus();
  const int64_t work = int64_t(rows) * heads * (head_dim / 2);
  const unsigned blocks = unsigned((work + kThreads - 1) / kThreads);
  biasRopeKernel<<<blocks, kThreads, 0, stream>>>(x, rows, row_stride, heads, head_dim, bias,
                                                  positions, cos_table, sin_table);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
