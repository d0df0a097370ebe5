// Paged attention: one block of 128 threads per (row, head), compiled per head size, or with
// parallel splits (few rows, long contexts) several blocks per (row, head), each taking splits
// z, z + kSplitBlocks, ... In each chunk of 128 positions, thread t scores position chunk + t;
// the chunk's maximum and sum go through fixed trees; then thread (part, d) accumulates dimension
// d over positions part, part + parts, ... in order (from the chunk's value rows, which thread t
// staged in shared memory with its key row). A split's parts are added in part order;
// splits are folded in split order by foldSplit.
#include "cuda/attention.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kSplitBlocks = 8;  // blocks per (row, head) with parallel splits
static_assert(kAttentionSplit % kChunk == 0, "a split is whole chunks");

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

// A split's result: the running maximum and sum of its online softmax, and (in the threads of
// part 0) dimension d's weighted sum of values.
struct SplitResult {
  float max, sum, total;
};

// Folds split s's result into the running fold of splits 0 .. s - 1 (the first split is taken as
// it is): one formula, in split order, wherever the splits ran.
__device__ __forceinline__ void foldSplit(SplitResult& into, const SplitResult& s) {
  const float m = fmaxf(into.max, s.max);
  const float a = expf(into.max - m), b = expf(s.max - m);
  into.sum = fmaf(into.sum, a, s.sum * b);
  into.total = fmaf(into.total, a, s.total * b);
  into.max = m;
}

// A chunk's value rows are staged here, position t's by thread t, 16 bytes at a time: piece i
// of row t at slot i ^ (t % pieces), so that neither the stores (eight rows at a time) nor the
// reads (one row, consecutive dimensions) fall in the same banks.
template <int HD>
struct Shared {
  static constexpr int kPieces = HD / 8;
  float q[HD];
  float probs[kChunk];
  float warp_values[kWarps];
  float partial[kThreads];
  uint4 values[kChunk][kPieces];
  __device__ float value(uint32_t position, int d) const {
    const int slot = (d / 8) ^ int(position % kPieces);
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&values[position][slot])[d % 8]);
  }
};

// The cache row of thread t's position in the chunk from `chunk` (0 past `end`).
__device__ __forceinline__ size_t chunkRow(const CacheRows& rows, uint32_t chunk, uint32_t end) {
  const uint32_t p = chunk + threadIdx.x;
  return p < end ? rows.at(p) : 0;
}

// The online softmax over positions [begin, end) of one row and head, in chunks of kChunk from
// begin. Every thread of the block calls it, with chunkRow(rows, begin, end) (looked up early by
// the caller); the result's total is valid in the threads of part 0.
template <int HD>
__device__ __forceinline__ SplitResult attendRange(const AttentionArgs& a, const CacheRows& rows,
                                                   Shared<HD>& sh, uint32_t begin, uint32_t end,
                                                   size_t at) {
  constexpr int kParts = kThreads / HD;
  const int t = threadIdx.x, part = t / HD, d = t % HD;
  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (uint32_t chunk = begin; chunk < end; chunk += kChunk) {
    const uint32_t count = min(uint32_t(kChunk), end - chunk);
    // The next chunk's block table entries load while this chunk is worked on.
    const size_t next_at = chunkRow(rows, chunk + kChunk, end);
    float score = -INFINITY;
    if (uint32_t(t) < count) {
      // The key and value rows in 16-byte pieces, all loads issued before the dot product uses
      // them: a chunk waits for the cache once, not once a position.
      const uint4 *k = reinterpret_cast<const uint4*>(a.k_cache + at),
                  *v = reinterpret_cast<const uint4*>(a.v_cache + at);
      uint4 pieces[HD / 8], values[HD / 8];
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) pieces[i] = k[i];
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) values[i] = v[i];
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) sh.values[t][i ^ (t % (HD / 8))] = values[i];
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&pieces[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 kv = __bfloat1622float2(pair[j]);
          dot = fmaf(sh.q[8 * i + 2 * j], kv.x, dot);
          dot = fmaf(sh.q[8 * i + 2 * j + 1], kv.y, dot);
        }
      }
      // Rounded here, never fused with the subtraction below: the same bits in every variant.
      score = __fmul_rn(dot, a.scale);
    }
    const float wmax = warpMax(score);
    if (t % 32 == 0) sh.warp_values[t / 32] = wmax;
    __syncthreads();
    float chunk_max = sh.warp_values[0];
    for (int w = 1; w < kWarps; ++w) chunk_max = fmaxf(chunk_max, sh.warp_values[w]);
    const float new_max = fmaxf(running_max, chunk_max);
    const float alpha = expf(running_max - new_max);  // 0 on the first chunk
    const float prob = uint32_t(t) < count ? expf(score - new_max) : 0.0f;
    sh.probs[t] = prob;
    const float wsum = warpSum(prob);
    __syncthreads();  // every thread has read warp_values
    if (t % 32 == 0) sh.warp_values[t / 32] = wsum;
    __syncthreads();
    float chunk_sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) chunk_sum += sh.warp_values[w];
    running_sum = fmaf(running_sum, alpha, chunk_sum);
    running_max = new_max;
    acc *= alpha;
    // Positions part, part + kParts, ... in order, from the staged values (the syncs above
    // follow their stores).
#pragma unroll 8
    for (uint32_t i = part; i < count; i += kParts) acc = fmaf(sh.probs[i], sh.value(i, d), acc);
    __syncthreads();  // probs, values and warp_values are rewritten by the next chunk
    at = next_at;
  }
  sh.partial[t] = acc;
  __syncthreads();
  float total = 0.0f;
  if (part == 0) {
    total = sh.partial[d];
    for (int p = 1; p < kParts; ++p) total += sh.partial[p * HD + d];
  }
  __syncthreads();  // partial is rewritten by the next split
  return {running_max, running_sum, total};
}

// Writes the row's output for this head from the fold of its splits, and adds the o product's
// expected sum and bound. Every thread of the block calls it.
template <int HD>
__device__ __forceinline__ void finish(const AttentionArgs& a, const SplitResult& folded) {
  const int h = blockIdx.x, r = blockIdx.y, t = threadIdx.x, part = t / HD, d = t % HD;
  double sums[2] = {};  // the o product's expected sum and bound
  if (part == 0) {
    const __nv_bfloat16 o = __float2bfloat16_rn(folded.total / folded.sum);
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

template <int HD, bool kParallel>
__global__ void __launch_bounds__(kThreads) attentionKernel(AttentionArgs a) {
  __shared__ Shared<HD> sh;
  __shared__ bool last;
  const int h = blockIdx.x, r = blockIdx.y, t = threadIdx.x, d = t % HD;
  const int kvh = h / (a.heads / a.kv_heads);
  // The positions and block tables are the step's inputs: read, with the first chunk's table
  // entries, before the wait for the kernel before (which writes the queries and the cache).
  const uint32_t len = a.positions[r] + 1;
  const uint32_t splits = (len + kAttentionSplit - 1) / kAttentionSplit;
  const int first = kParallel ? int(blockIdx.z) : 0, step = kParallel ? kSplitBlocks : 1;
  const CacheRows rows{a.block_tables + a.row_table[r], size_t(kvh) * a.block_size * HD,
                       size_t(a.kv_heads) * a.block_size * HD, uint32_t(a.block_size), HD};
  auto splitEnd = [&](uint32_t s) { return min(len, (s + 1) * uint32_t(kAttentionSplit)); };
  const size_t first_at =
      uint32_t(first) < splits
          ? chunkRow(rows, uint32_t(first) * kAttentionSplit, splitEnd(uint32_t(first)))
          : 0;
  gridDependencyWait();
  allowDependentLaunch();
  if (uint32_t(first) >= splits) return;  // the whole block: nothing of this row is left
  if (t < HD) sh.q[t] = a.q[size_t(r) * a.q_stride + size_t(h) * HD + t];
  __syncthreads();
  auto range = [&](uint32_t s) {
    const uint32_t begin = s * kAttentionSplit;
    return attendRange<HD>(a, rows, sh, begin, splitEnd(s),
                           s == uint32_t(first) ? first_at : chunkRow(rows, begin, splitEnd(s)));
  };
  if (!kParallel || splits == 1) {
    SplitResult folded = range(0);
    for (uint32_t s = 1; s < splits; ++s) foldSplit(folded, range(s));
    return finish<HD>(a, folded);
  }
  // Side by side: each split's result to the partials; the block that completes the row's last
  // split folds them all, in split order.
  float* partials = a.split_partials + (size_t(r) * a.heads + h) * a.max_splits * (HD + 2);
  unsigned mine = 0;
  for (uint32_t s = uint32_t(first); s < splits; s += uint32_t(step), ++mine) {
    const SplitResult result = range(s);
    float* at = partials + size_t(s) * (HD + 2);
    if (t < HD) at[d] = result.total;  // part 0 holds the totals
    if (t == 0) {
      at[HD] = result.max;
      at[HD + 1] = result.sum;
    }
  }
  __threadfence();
  __syncthreads();
  if (t == 0) {
    unsigned* count = a.split_counts + size_t(r) * a.heads + h;
    last = atomicAdd(count, mine) + mine == splits;
    if (last) *count = 0;  // left zero for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  auto load = [&](uint32_t s) {
    const float* at = partials + size_t(s) * (HD + 2);
    return SplitResult{__ldcg(at + HD), __ldcg(at + HD + 1), t < HD ? __ldcg(at + d) : 0.0f};
  };
  SplitResult folded = load(0);
  for (uint32_t s = 1; s < splits; ++s) foldSplit(folded, load(s));
  finish<HD>(a, folded);
}

template <int HD>
cudaError_t launchHeadDim(const AttentionArgs& a, cudaStream_t stream) {
  if (a.parallel_splits)
    return launchKernel(attentionKernel<HD, true>,
                        dim3(unsigned(a.heads), unsigned(a.rows), unsigned(kSplitBlocks)), kThreads,
                        stream, a);
  return launchKernel(attentionKernel<HD, false>, dim3(unsigned(a.heads), unsigned(a.rows)),
                      kThreads, stream, a);
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
  if (a.parallel_splits && (a.rows > kAttentionParallelRows || a.split_partials == nullptr ||
                            a.split_counts == nullptr || a.max_splits <= 0))
    return invalidArgument("attention with parallel splits over " + std::to_string(a.rows) +
                           " rows (at most " + std::to_string(kAttentionParallelRows) +
                           ", with partials and counts)");
  cudaError_t launched;
  switch (a.head_dim) {
    case 16:
      launched = launchHeadDim<16>(a, stream);
      break;
    case 32:
      launched = launchHeadDim<32>(a, stream);
      break;
    case 64:
      launched = launchHeadDim<64>(a, stream);
      break;
    default:
      launched = launchHeadDim<128>(a, stream);
      break;
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(launched);
  return okStatus();
}

}  // namespace bulkhead::cuda
