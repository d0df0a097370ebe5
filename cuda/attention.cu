// Paged attention: one block of 128 threads per (row, head). In each chunk of 128 positions,
// thread t scores position chunk + t; the chunk's maximum and sum go through fixed trees; then
// thread (part, d) accumulates dimension d over positions part, part + parts, ... in order.
#include "cuda/attention.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 128;

__device__ float warpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ float warpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void __launch_bounds__(kThreads) attentionKernel(AttentionArgs a) {
  __shared__ float q[kMaxHeadDim];
  __shared__ float probs[kChunk];
  __shared__ float warp_values[kWarps];
  __shared__ float partial[kThreads];
  __shared__ double scratch[kWarps];
  const int h = blockIdx.x, r = blockIdx.y, t = threadIdx.x;
  const int hd = a.head_dim, parts = kThreads / hd, part = t / hd, d = t % hd;
  const int kvh = h / (a.heads / a.kv_heads);
  const uint32_t len = a.positions[r] + 1;
  const uint32_t* table = a.block_tables + a.row_table[r];
  const size_t head_stride = size_t(a.block_size) * hd;
  auto rowOf = [&](const __nv_bfloat16* cache, uint32_t p) {
    const uint32_t block = table[p / uint32_t(a.block_size)];
    return cache + (size_t(block) * a.kv_heads + kvh) * head_stride +
           size_t(p % uint32_t(a.block_size)) * hd;
  };
  if (t < hd) q[t] = a.q[size_t(r) * a.q_stride + size_t(h) * hd + t];
  __syncthreads();

  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (uint32_t chunk = 0; chunk < len; chunk += kChunk) {
    const uint32_t count = min(uint32_t(kChunk), len - chunk);
    float score = -INFINITY;
    if (uint32_t(t) < count) {
      const __nv_bfloat162* k =
          reinterpret_cast<const __nv_bfloat162*>(rowOf(a.k_cache, chunk + t));
      float dot = 0.0f;
      for (int i = 0; i < hd / 2; ++i) {
        const float2 kv = __bfloat1622float2(k[i]);
        dot = fmaf(q[2 * i], kv.x, dot);
        dot = fmaf(q[2 * i + 1], kv.y, dot);
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
    for (uint32_t i = part; i < count; i += parts)
      acc = fmaf(probs[i], __bfloat162float(rowOf(a.v_cache, chunk + i)[d]), acc);
    __syncthreads();  // probs and warp_values are rewritten by the next chunk
  }
  partial[t] = acc;
  __syncthreads();
  double expected = 0.0, bound = 0.0;
  if (part == 0) {
    float total = partial[d];
    for (int p = 1; p < parts; ++p) total += partial[p * hd + d];
    const __nv_bfloat16 o = __float2bfloat16_rn(total / running_sum);
    const int e = h * hd + d;
    a.out[size_t(r) * a.heads * hd + e] = o;
    if (a.consumer.role >= 0) {
      const float of = __bfloat162float(o);
      expected = double(a.consumer.colsum[e]) * of;
      bound = double(a.consumer.abssum[e]) * fabsf(of);
    }
  }
  if (a.consumer.role >= 0) {
    expected = blockSum(expected, scratch);
    bound = blockSum(bound, scratch);
    if (t == 0) {
      ProductCheck& p = a.checks.products[size_t(r) * a.checks.roles + a.consumer.role];
      atomicAdd(&p.expected, expected);
      atomicAdd(&p.bound, bound);
    }
  }
}

}  // namespace

bool attentionSupportsHeadDim(int head_dim) {
  return head_dim >= 2 && head_dim <= kMaxHeadDim && head_dim % 2 == 0 && kThreads % head_dim == 0;
}

Status launchAttention(const AttentionArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0 ||
      !attentionSupportsHeadDim(a.head_dim) || a.block_size <= 0 ||
      a.q_stride < a.heads * a.head_dim)
    return invalidArgument("attention of " + std::to_string(a.heads) + " heads over " +
                           std::to_string(a.kv_heads) + " kv heads of " +
                           std::to_string(a.head_dim));
  if (a.rows == 0) return okStatus();
  attentionKernel<<<dim3(unsigned(a.heads), unsigned(a.rows)), kThreads, 0, stream>>>(a);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
