// Paged attention: one block of 128 threads per (row, head), compiled per head size. In each
// chunk of 128 positions, thread t scores position chunk + t; the chunk's maximum and sum go
// through fixed trees; then thread (part, d) accumulates dimension d over positions part,
// part + parts, ... in order.
#include "cuda/attention.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = kThreads;
constexpr int kWarps = kThreads / 32;

__device__ float warpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ float warpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The cache row of position p for this block's KV head.
struct CacheRows {
  const uint32_t* table;
  size_t head_offset;   // kv_head * block_size * head_dim
  size_t block_stride;  // kv_heads * block_size * head_dim
  uint32_t block_size;
  int head_dim;
  __device__ size_t at(uint32_t p) const {
    return size_t(table[p / block_size]) * block_stride + head_offset +
           size_t(p % block_size) * head_dim;
  }
};

template <int HD>
__global__ void __launch_bounds__(kThreads) attentionKernel(AttentionArgs a) {
  constexpr int kParts = kThreads / HD;
  constexpr int kUnroll = 8;
  __shared__ float q[HD];
  __shared__ float probs[kChunk];
  __shared__ float warp_values[kWarps];
  __shared__ float partial[kThreads];
  gridDependencyWait();
  allowDependentLaunch();
  const int h = blockIdx.x, r = blockIdx.y, t = threadIdx.x;
  const int part = t / HD, d = t % HD;
  const int kvh = h / (a.heads / a.kv_heads);
  const uint32_t len = a.positions[r] + 1;
  const CacheRows rows{a.block_tables + a.row_table[r], size_t(kvh) * a.block_size * HD,
                       size_t(a.kv_heads) * a.block_size * HD, uint32_t(a.block_size), HD};
  if (t < HD) q[t] = a.q[size_t(r) * a.q_stride + size_t(h) * HD + t];
  __syncthreads();

  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (uint32_t chunk = 0; chunk < len; chunk += kChunk) {
    const uint32_t count = min(uint32_t(kChunk), len - chunk);
    float score = -INFINITY;
    if (uint32_t(t) < count) {
      // The key row in 16-byte pieces, all loads issued before the dot product uses them.
      const uint4* k = reinterpret_cast<const uint4*>(a.k_cache + rows.at(chunk + t));
      uint4 pieces[HD / 8];
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) pieces[i] = k[i];
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&pieces[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 kv = __bfloat1622float2(pair[j]);
          dot = fmaf(q[8 * i + 2 * j], kv.x, dot);
          dot = fmaf(q[8 * i + 2 * j + 1], kv.y, dot);
        }
      }
      score = dot * a.scale;
    }
    const float wmax = warpMax(score);
    if (t % 32 == 0) warp_values[t / 32] = wmax;
    __syncthreads();
    float chunk_max = warp_values[0];
    for (int w = 1; w < kWarps; ++w) chunk_max = fmaxf(chunk_max, warp_values[w]);
    const float new_max = fmaxf(running_max, chunk_max);
    const float alpha = expf(running_max - new_max);  // 0 on the first chunk
    const float prob = uint32_t(t) < count ? expf(score - new_max) : 0.0f;
    probs[t] = prob;
    const float wsum = warpSum(prob);
    __syncthreads();  // every thread has read warp_values
    if (t % 32 == 0) warp_values[t / 32] = wsum;
    __syncthreads();
    float chunk_sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) chunk_sum += warp_values[w];
    running_sum = fmaf(running_sum, alpha, chunk_sum);
    running_max = new_max;
    acc *= alpha;
    // Positions part, part + kParts, ... in order; loads in groups of kUnroll, so they are in
    // flight together, the multiply-adds still one after another.
    uint32_t i = part;
    for (; i + (kUnroll - 1) * kParts < count; i += kUnroll * kParts) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        v[u] = __bfloat162float(a.v_cache[rows.at(chunk + i + u * kParts) + d]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc = fmaf(probs[i + u * kParts], v[u], acc);
    }
    for (; i < count; i += kParts)
      acc = fmaf(probs[i], __bfloat162float(a.v_cache[rows.at(chunk + i) + d]), acc);
    __syncthreads();  // probs and warp_values are rewritten by the next chunk
  }
  partial[t] = acc;
  __syncthreads();
  double sums[2] = {};  // the o product's expected sum and bound
  if (part == 0) {
    float total = partial[d];
    for (int p = 1; p < kParts; ++p) total += partial[p * HD + d];
    const __nv_bfloat16 o = __float2bfloat16_rn(total / running_sum);
    const int e = h * HD + d;
    a.out[size_t(r) * a.heads * HD + e] = o;
    if (a.consumer.role >= 0) {
      const float of = __bfloat162float(o);
      sums[0] = double(a.consumer.colsum[e]) * of;
      sums[1] = double(a.consumer.abssum[e]) * fabsf(of);
    }
  }
  if (a.consumer.role >= 0) {
    warpSums(sums);
    if (t % 32 == 0) {
      ProductCheck& p = a.checks.products[size_t(r) * a.checks.roles + a.consumer.role];
      atomicAdd(&p.expected, sums[0]);
      atomicAdd(&p.bound, sums[1]);
    }
  }
}

}  // namespace

bool attentionSupportsHeadDim(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

Status launchAttention(const AttentionArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0 ||
      !attentionSupportsHeadDim(a.head_dim) || a.block_size <= 0 ||
      a.q_stride < a.heads * a.head_dim)
    return invalidArgument("attention of " + std::to_string(a.heads) + " heads over " +
                           std::to_string(a.kv_heads) + " kv heads of " +
                           std::to_string(a.head_dim));
  if (a.rows == 0) return okStatus();
  const dim3 grid(unsigned(a.heads), unsigned(a.rows));
  cudaError_t launched;
  switch (a.head_dim) {
    case 16:
      launched = launchKernel(attentionKernel<16>, grid, kThreads, stream, a);
      break;
    case 32:
      launched = launchKernel(attentionKernel<32>, grid, kThreads, stream, a);
      break;
    case 64:
      launched = launchKernel(attentionKernel<64>, grid, kThreads, stream, a);
      break;
    default:
      launched = launchKernel(attentionKernel<128>, grid, kThreads, stream, a);
      break;
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(launched);
  return okStatus();
}

}  // namespace bulkhead::cuda
