// Bias + RoPE + KV write: a thread per pair of q or k, or element of v.
#include "cuda/rope.cuh"

#include <cmath>
#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;

// grid: (blocks per row, rows); one thread per item of a row: a pair of q, a pair of k, or an
// element of v, in that order. Everything but the products' outputs (the position, its cos and
// sin, the biases, the cache slot) loads before the wait for the kernel before, and each thread
// folds one word of the biases (q's words, then k's, then v's: a row's threads cover them all
// once, there being more items than words).
__global__ void __launch_bounds__(kThreads) qkvKernel(QkvArgs a) {
  const int r = blockIdx.y, half = a.head_dim / 2;
  const int q_dim = a.heads * a.head_dim, kv_dim = a.kv_heads * a.head_dim;
  const int q_pairs = a.heads * half, k_pairs = a.kv_heads * half;
  const int item = blockIdx.x * kThreads + threadIdx.x;
  const uint32_t p = a.positions[r];
  const int head_stride = a.block_size * a.head_dim;
  // This position's place in the cache: head h of k at k_at + h * head_stride.
  __nv_bfloat16 *k_at = nullptr, *v_at = nullptr;
  if (a.k_cache != nullptr) {
    const size_t slot = size_t(a.row_block[r]) * a.kv_heads * head_stride +
                        size_t(p % uint32_t(a.block_size)) * a.head_dim;
    k_at = a.k_cache + slot;
    v_at = a.v_cache + slot;
  }
  const bool is_pair = item < q_pairs + k_pairs, is_q = item < q_pairs;
  const bool is_v = !is_pair && item < q_pairs + k_pairs + kv_dim;
  const int pair = is_q ? item : item - q_pairs, h = pair / half, i = pair % half;
  const int e = is_pair ? h * a.head_dim + i : item - q_pairs - k_pairs;  // within q, k or v
  float bias0 = 0.0f, bias1 = 0.0f, c = 0.0f, sn = 0.0f;
  const __nv_bfloat16* bias = is_q ? a.bias[0] : is_pair ? a.bias[1] : a.bias[2];
  if (is_pair) {
    if (bias != nullptr) {
      bias0 = __bfloat162float(bias[e]);
      bias1 = __bfloat162float(bias[e + half]);
    }
    c = a.cos_table[size_t(p) * half + i];
    sn = a.sin_table[size_t(p) * half + i];
  } else if (is_v && bias != nullptr) {
    bias0 = __bfloat162float(bias[e]);
  }
  unsigned long long fold[3] = {}, fold_words[3] = {};
  {
    const int words[3] = {q_dim / 2, kv_dim / 2, kv_dim / 2};
    int w = item;
#pragma unroll
    for (int b = 0; b < 3; w -= words[b], ++b) {
      if (w < 0 || w >= words[b]) continue;
      if (a.bias[b] != nullptr && a.bias_fold[b] >= 0) {
        fold[b] =
            foldTerm(reinterpret_cast<const uint32_t*>(a.bias[b])[w], a.bias_salt[b], uint32_t(w));
        fold_words[b] = 1;
      }
    }
  }
  awaitKernelBefore();
  float* row = a.qkv + size_t(r) * a.stride;
  double produced[8] = {};  // the q, k and v products' sums, then their sums of squares; 2 spare
  if (is_pair) {
    float* u = is_q ? row : row + q_dim;
    float x0 = u[e], x1 = u[e + half];
    const double sum = double(x0) + double(x1),
                 sq = double(x0) * double(x0) + double(x1) * double(x1);
    produced[0] = is_q ? sum : 0.0;
    produced[1] = is_q ? 0.0 : sum;
    produced[3] = is_q ? sq : 0.0;
    produced[4] = is_q ? 0.0 : sq;
    if (bias != nullptr) {
      x0 = __fadd_rn(x0, bias0);
      x1 = __fadd_rn(x1, bias1);
    }
    // As the CPU engine computes it: two rounded multiplies, then one rounded subtraction or
    // addition (the _rn intrinsics are never contracted into fused multiply-adds).
    const float r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
    const float r1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn));
    if (is_q || k_at == nullptr) {
      u[e] = r0;
      u[e + half] = r1;
    } else {
      __nv_bfloat16* dst = k_at + size_t(h) * head_stride;
      dst[i] = __float2bfloat16_rn(r0);
      dst[i + half] = __float2bfloat16_rn(r1);
    }
  } else if (is_v) {
    float v = row[q_dim + kv_dim + e];
    produced[2] = double(v);
    produced[5] = double(v) * double(v);
    if (bias != nullptr) v = __fadd_rn(v, bias0);
    if (v_at != nullptr)
      v_at[size_t(e / a.head_dim) * head_stride + e % a.head_dim] = __float2bfloat16_rn(v);
    else
      row[q_dim + kv_dim + e] = v;
  }
  // Folds and sums over the block, then one atomic add each (a 7B row has 10 blocks of 8 warps).
  __shared__ union {
    unsigned long long folds[kThreads / 32 * 6];
    double sums[kThreads / 32 * 8];
  } scratch;
  FoldAccount* const accounts[3] = {
      a.bias[0] != nullptr && a.bias_fold[0] >= 0 ? a.checks.folds + a.bias_fold[0] : nullptr,
      a.bias[1] != nullptr && a.bias_fold[1] >= 0 ? a.checks.folds + a.bias_fold[1] : nullptr,
      a.bias[2] != nullptr && a.bias_fold[2] >= 0 ? a.checks.folds + a.bias_fold[2] : nullptr};
  if (accounts[0] != nullptr || accounts[1] != nullptr || accounts[2] != nullptr) {
    addBlockFolds(accounts, fold, fold_words, scratch.folds);
    __syncthreads();  // scratch is reused below
  }
  if (a.product_role[0] < 0 && a.product_role[1] < 0 && a.product_role[2] < 0) return;
  const double total = blockTotal<8>(warpTotalSpread(produced), scratch.sums);
  const int value = int(threadIdx.x);
  if (value > 5) return;
  const int b = value % 3,  // selects, not an index into the parameters
      role = b == 0   ? a.product_role[0]
             : b == 1 ? a.product_role[1]
                      : a.product_role[2];
  if (role < 0) return;
  ProductCheck& pc = a.checks.products[size_t(r) * a.checks.roles + role];
  atomicAdd(value < 3 ? &pc.produced : &pc.produced_sq, total);
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
  const int items = (a.heads + a.kv_heads) * (a.head_dim / 2) + a.kv_heads * a.head_dim;
  const dim3 grid(unsigned((items + kThreads - 1) / kThreads), unsigned(a.rows));
  BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(qkvKernel, grid, kThreads, stream, a));
  return okStatus();
}

}  // namespace bulkhead::cuda
