// Bias + RoPE + KV write: one block per row; threads stride over the row's (head, pair)s.
#include "cuda/rope.cuh"

#include <cmath>
#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// Rotates the pairs of `heads` heads of u (bias added first), writing back into u or, when
// `cache` is set, into the cache. Returns this thread's share of the raw values' sum.
__device__ double rotateHeads(float* u, int heads, int head_dim, const __nv_bfloat16* bias,
                              const float* cos_row, const float* sin_row, bool write_back,
                              __nv_bfloat16* cache, int kv_stride_heads) {
  const int half = head_dim / 2;
  double produced = 0.0;
  for (int idx = threadIdx.x; idx < heads * half; idx += kThreads) {
    const int h = idx / half, i = idx % half;
    const int e = h * head_dim + i;
    float a = u[e], b = u[e + half];
    produced += double(a) + double(b);
    if (bias != nullptr) {
      a = __fadd_rn(a, __bfloat162float(bias[e]));
      b = __fadd_rn(b, __bfloat162float(bias[e + half]));
    }
    const float c = cos_row[i], s = sin_row[i];
    // As the CPU engine computes it: two rounded multiplies, then one rounded subtraction or
    // addition (the _rn intrinsics are never contracted into fused multiply-adds).
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    if (write_back) {
      u[e] = ra;
      u[e + half] = rb;
    }
    if (cache != nullptr) {
      __nv_bfloat16* dst = cache + size_t(h) * kv_stride_heads;
      dst[i] = __float2bfloat16_rn(ra);
      dst[i + half] = __float2bfloat16_rn(rb);
    }
  }
  return produced;
}

__global__ void __launch_bounds__(kThreads) qkvKernel(QkvArgs a) {
  __shared__ double scratch[kWarps];
  __shared__ unsigned long long fold_scratch[kWarps];
  const int r = blockIdx.x, half = a.head_dim / 2;
  const int q_dim = a.heads * a.head_dim, kv_dim = a.kv_heads * a.head_dim;
  float* row = a.qkv + size_t(r) * a.stride;
  const uint32_t p = a.positions[r];
  const float* cos_row = a.cos_table + size_t(p) * half;
  const float* sin_row = a.sin_table + size_t(p) * half;
  // The cache rows of this position: head h of k at k_at + h * block_size * head_dim.
  __nv_bfloat16 *k_at = nullptr, *v_at = nullptr;
  const int head_stride = a.block_size * a.head_dim;
  if (a.k_cache != nullptr) {
    const size_t slot = size_t(a.row_block[r]) * a.kv_heads * head_stride +
                        size_t(p % uint32_t(a.block_size)) * a.head_dim;
    k_at = a.k_cache + slot;
    v_at = a.v_cache + slot;
  }
  double produced[3];
  produced[0] =
      rotateHeads(row, a.heads, a.head_dim, a.bias[0], cos_row, sin_row, true, nullptr, 0);
  produced[1] = rotateHeads(row + q_dim, a.kv_heads, a.head_dim, a.bias[1], cos_row, sin_row,
                            k_at == nullptr, k_at, head_stride);
  produced[2] = 0.0;
  for (int e = threadIdx.x; e < kv_dim; e += kThreads) {
    float v = row[q_dim + kv_dim + e];
    produced[2] += double(v);
    if (a.bias[2] != nullptr) v = __fadd_rn(v, __bfloat162float(a.bias[2][e]));
    if (v_at != nullptr)
      v_at[size_t(e / a.head_dim) * head_stride + e % a.head_dim] = __float2bfloat16_rn(v);
    else
      row[q_dim + kv_dim + e] = v;
  }
  for (int i = 0; i < 3; ++i) {
    if (a.bias[i] != nullptr && a.bias_fold[i] >= 0) {
      const int words = (i == 0 ? q_dim : kv_dim) / 2;
      foldVector(reinterpret_cast<const uint32_t*>(a.bias[i]), words, a.bias_salt[i],
                 a.checks.folds + a.bias_fold[i], fold_scratch);
    }
    if (a.product_role[i] >= 0) {
      const double total = blockSum(produced[i], scratch);
      if (threadIdx.x == 0)
        atomicAdd(&a.checks.products[size_t(r) * a.checks.roles + a.product_role[i]].produced,
                  total);
    }
  }
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

Status launchQkv(const QkvArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.heads <= 0 || a.kv_heads <= 0 || a.head_dim <= 0 || a.head_dim % 2 != 0 ||
      int64_t(a.heads + 2 * a.kv_heads) * a.head_dim > a.stride ||
      (a.k_cache != nullptr &&
       (a.v_cache == nullptr || a.row_block == nullptr || a.block_size <= 0)))
    return invalidArgument("q/k/v of " + std::to_string(a.heads) + "+2x" +
                           std::to_string(a.kv_heads) + " heads of " + std::to_string(a.head_dim) +
                           " in rows of " + std::to_string(a.stride));
  if (a.rows == 0) return okStatus();
  qkvKernel<<<a.rows, kThreads, 0, stream>>>(a);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
