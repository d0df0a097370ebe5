// Paged attention: one block of 128 threads per (row, head), compiled per head size, or with
// parallel splits (few rows, long contexts) several blocks per (row, head), each taking splits
// z, z + split_blocks, ... In each chunk of 128 positions, thread t scores position chunk
// + t; the chunk's maximum and sum go through fixed trees; then thread (part, d) accumulates
// dimension d over positions part, part + parts, ... in order (from the chunk's value rows, which
// thread t staged in shared memory with its key row). A split's parts are added in part order;
// splits are folded in split order by foldSplit. With paired chunks a block loads two chunks at
// once and works on them chunk by chunk in that same order.
#include "cuda/attention.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = kThreads;
constexpr int kWarps = kThreads / 32;
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
// kRows query rows of one sequence share each chunk's loads (a prefill tile); each row gets the
// same operations in the same order as alone. kChunks: chunks staged at once (paired chunks, one
// row), probs and warp_values then per chunk.
template <int HD, int kRows = 1, int kChunks = 1>
struct Shared {
  static_assert(kRows == 1 || kChunks == 1, "several rows or several chunks");
  static constexpr int kPieces = HD / 8;
  float q[kRows][HD];
  float probs[kRows * kChunks][kChunk];
  float warp_values[kRows * kChunks][kWarps];
  float partial[kRows][kThreads];
  uint4 values[kChunks][kChunk][kPieces];
  uint4 fresh_k[kPieces], fresh_v[kPieces];  // rope_in: the row's own key and value (bf16)
  __device__ float value(uint32_t position, int d, int c = 0) const {
    const int slot = (d / 8) ^ int(position % kPieces);
    return __bfloat162float(
        reinterpret_cast<const __nv_bfloat16*>(&values[c][position][slot])[d % 8]);
  }
};

// The cache row of thread t's position in the chunk from `chunk` (0 past `end`).
__device__ __forceinline__ size_t chunkRow(const CacheRows& rows, uint32_t chunk, uint32_t end) {
  const uint32_t p = chunk + threadIdx.x;
  return p < end ? rows.at(p) : 0;
}

// Thread t's position in a chunk: its key row into `pieces` and its value row staged into the
// chunk's shared value rows, all loads issued before either is used (a chunk waits for the cache
// once, not once a position).
template <int HD, int kRows>
__device__ __forceinline__ void loadKeyStageValue(const AttentionArgs& a, size_t at,
                                                  Shared<HD, kRows>& sh, uint4 (&pieces)[HD / 8]) {
  const int t = threadIdx.x;
  const uint4 *k = reinterpret_cast<const uint4*>(a.k_cache + at),
              *v = reinterpret_cast<const uint4*>(a.v_cache + at);
  uint4 values[HD / 8];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) pieces[i] = k[i];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) values[i] = v[i];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) sh.values[0][t][i ^ (t % (HD / 8))] = values[i];
}

// A query's score against a key row: the dot product in dimension order, then the scale,
// rounded on its own (never fused with the subtraction after it): every path's bits.
template <int HD>
__device__ __forceinline__ float scoreOf(const float (&q)[HD], const uint4 (&pieces)[HD / 8],
                                         float scale) {
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
  return __fmul_rn(dot, scale);
}

// A row's dimension d summed over the block's parts (part order) from each thread's acc: valid
// in the threads of part 0. Every thread of the block calls it.
template <int HD, int kChunks>
__device__ __forceinline__ float partsTotal(Shared<HD, 1, kChunks>& sh, float acc) {
  constexpr int kParts = kThreads / HD;
  const int t = threadIdx.x, part = t / HD, d = t % HD;
  sh.partial[0][t] = acc;
  __syncthreads();
  float total = 0.0f;
  if (part == 0) {
    total = sh.partial[0][d];
    for (int p = 1; p < kParts; ++p) total += sh.partial[0][p * HD + d];
  }
  __syncthreads();  // partial is rewritten by the next split
  return total;
}

// The online softmax over positions [begin, end) of one row and head, in chunks of kChunk from
// begin. Every thread of the block calls it, with `at` = chunkRow(rows, begin, end) (looked up
// early by the caller); `at` is left as chunkRow(rows, end, ahead), the first chunk of the split
// that follows when ahead reaches past end (its table entries load during this split's last
// chunk, not after it). The result's total is valid in the threads of part 0.
template <int HD, bool kRope>
__device__ __forceinline__ SplitResult attendRow(const AttentionArgs& a, const CacheRows& rows,
                                                 Shared<HD, 1>& sh, uint32_t begin, uint32_t end,
                                                 uint32_t ahead, size_t& at, uint32_t fresh) {
  constexpr int kParts = kThreads / HD;
  const int t = threadIdx.x, part = t / HD, d = t % HD;
  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (uint32_t chunk = begin; chunk < end; chunk += kChunk) {
    const uint32_t count = min(uint32_t(kChunk), end - chunk);
    // The next chunk's block table entries load while this chunk is worked on.
    const size_t next_at = chunkRow(rows, chunk + kChunk, ahead);
    float score = -INFINITY;
    if (uint32_t(t) < count) {
      uint4 pieces[HD / 8];
      if (kRope && chunk + t == fresh) {
        // The row's own position (rope_in) from shared memory: the cache's copy is written by
        // another block of this launch.
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
          pieces[i] = sh.fresh_k[i];
          sh.values[0][t][i ^ (t % (HD / 8))] = sh.fresh_v[i];
        }
      } else {
        loadKeyStageValue(a, at, sh, pieces);
      }
      score = scoreOf<HD>(sh.q[0], pieces, a.scale);
    }
    const float wmax = warpMax(score);
    if (t % 32 == 0) sh.warp_values[0][t / 32] = wmax;
    __syncthreads();
    float chunk_max = sh.warp_values[0][0];
    for (int w = 1; w < kWarps; ++w) chunk_max = fmaxf(chunk_max, sh.warp_values[0][w]);
    const float new_max = fmaxf(running_max, chunk_max);
    const float alpha = expf(running_max - new_max);  // 0 on the first chunk
    const float prob = uint32_t(t) < count ? expf(score - new_max) : 0.0f;
    sh.probs[0][t] = prob;
    const float wsum = warpSum(prob);
    __syncthreads();  // every thread has read warp_values
    if (t % 32 == 0) sh.warp_values[0][t / 32] = wsum;
    __syncthreads();
    float chunk_sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) chunk_sum += sh.warp_values[0][w];
    running_sum = fmaf(running_sum, alpha, chunk_sum);
    running_max = new_max;
    acc *= alpha;
    // Positions part, part + kParts, ... in order, from the staged values (the syncs above
    // follow their stores).
#pragma unroll 8
    for (uint32_t i = part; i < count; i += kParts) acc = fmaf(sh.probs[0][i], sh.value(i, d), acc);
    __syncthreads();  // probs, values and warp_values are rewritten by the next chunk
    at = next_at;
  }
  return {running_max, running_sum, partsTotal(sh, acc)};
}

// attendRow two chunks at a time (paired chunks): both chunks' keys and values load together, and
// their maxima and sums cross the block's barriers together, so a pair waits on memory and on the
// barriers once rather than once a chunk. The arithmetic is attendRow's, chunk by chunk in order:
// the second chunk's maximum, probabilities and rescaling start from the first's running values,
// the sums and the accumulation (the same threads, parts and order) are the same expressions, so
// the same bits. `at` holds the pair's two cache rows (chunkRow) and is left as the next pair's,
// looked up `ahead` as attendRow does (the next split's first pair past `end`).
template <int HD, bool kRope>
__device__ __forceinline__ SplitResult attendRowPaired(const AttentionArgs& a,
                                                       const CacheRows& rows, Shared<HD, 1, 2>& sh,
                                                       uint32_t begin, uint32_t end, uint32_t ahead,
                                                       size_t (&at)[2], uint32_t fresh) {
  constexpr int kParts = kThreads / HD;
  const int t = threadIdx.x, part = t / HD, d = t % HD;
  float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
  for (uint32_t chunk = begin; chunk < end; chunk += 2 * kChunk) {
    const uint32_t count[2] = {
        min(uint32_t(kChunk), end - chunk),
        chunk + kChunk < end ? min(uint32_t(kChunk), end - chunk - kChunk) : 0u};
    // The next pair's block table entries load while this pair is worked on: the split's next
    // pair, or after its last the next split's first (a split of an odd number of chunks ends
    // with a pair of one).
    const uint32_t next = chunk + 2 * kChunk < end ? chunk + 2 * kChunk : end;
    const size_t next_at[2] = {chunkRow(rows, next, ahead), chunkRow(rows, next + kChunk, ahead)};
    float score[2] = {-INFINITY, -INFINITY};
    // Both chunks' key and value rows loaded before any is used or staged; the row's own position
    // (rope_in) from shared memory instead, as in attendRow.
    uint4 pieces[2][HD / 8], values[2][HD / 8];
    bool own[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      own[c] = kRope && chunk + uint32_t(c * kChunk + t) == fresh;
      if (uint32_t(t) >= count[c] || own[c]) continue;
      const uint4 *k = reinterpret_cast<const uint4*>(a.k_cache + at[c]),
                  *v = reinterpret_cast<const uint4*>(a.v_cache + at[c]);
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) pieces[c][i] = k[i];
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) values[c][i] = v[i];
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (uint32_t(t) >= count[c]) continue;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        if (own[c]) {
          pieces[c][i] = sh.fresh_k[i];
          values[c][i] = sh.fresh_v[i];
        }
        sh.values[c][t][i ^ (t % (HD / 8))] = values[c][i];
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      if (uint32_t(t) < count[c]) score[c] = scoreOf<HD>(sh.q[0], pieces[c], a.scale);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float wmax = warpMax(score[c]);
      if (t % 32 == 0) sh.warp_values[c][t / 32] = wmax;
    }
    __syncthreads();
    float chunk_max[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      chunk_max[c] = sh.warp_values[c][0];
      for (int w = 1; w < kWarps; ++w) chunk_max[c] = fmaxf(chunk_max[c], sh.warp_values[c][w]);
    }
    // Chunk by chunk as attendRow: the second from the first's new maximum.
    float new_max[2], alpha[2], prob[2];
    new_max[0] = fmaxf(running_max, chunk_max[0]);
    alpha[0] = expf(running_max - new_max[0]);  // 0 on the first chunk
    new_max[1] = count[1] > 0 ? fmaxf(new_max[0], chunk_max[1]) : new_max[0];
    alpha[1] = expf(new_max[0] - new_max[1]);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      prob[c] = uint32_t(t) < count[c] ? expf(score[c] - new_max[c]) : 0.0f;
      sh.probs[c][t] = prob[c];
      prob[c] = warpSum(prob[c]);  // the warp's sum from here on
    }
    __syncthreads();  // every thread has read warp_values
#pragma unroll
    for (int c = 0; c < 2; ++c)
      if (t % 32 == 0) sh.warp_values[c][t / 32] = prob[c];
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (count[c] == 0) break;  // the same for the whole block
      float chunk_sum = 0.0f;
      for (int w = 0; w < kWarps; ++w) chunk_sum += sh.warp_values[c][w];
      running_sum = fmaf(running_sum, alpha[c], chunk_sum);
      acc *= alpha[c];
#pragma unroll 8
      for (uint32_t i = part; i < count[c]; i += kParts)
        acc = fmaf(sh.probs[c][i], sh.value(i, d, c), acc);
    }
    running_max = new_max[1];
    __syncthreads();  // probs, values and warp_values are rewritten by the next pair
    at[0] = next_at[0];
    at[1] = next_at[1];
  }
  return {running_max, running_sum, partsTotal(sh, acc)};
}

// attendRow for kRows rows of one sequence at once (a prefill tile), over positions [begin,
// end[j]) for row j (nothing where end[j] <= begin): each chunk's keys and values load once for
// all of them. Each row's operations and their order are attendRow's for that row alone (the
// same expressions; a chunk past a row's end is skipped for it), so the same bits. Every thread
// of the block calls it, with `at` = chunkRow(rows, begin, the largest end), which it leaves
// looked up `ahead` as attendRow does; the totals are valid in the threads of part 0.
template <int HD, int kRows>
__device__ __forceinline__ void attendTile(const AttentionArgs& a, const CacheRows& rows,
                                           Shared<HD, kRows>& sh, uint32_t begin,
                                           const uint32_t (&end)[kRows], uint32_t ahead, size_t& at,
                                           SplitResult (&out)[kRows]) {
  constexpr int kParts = kThreads / HD;
  const int t = threadIdx.x, part = t / HD, d = t % HD;
  uint32_t last_end = end[0];
#pragma unroll
  for (int j = 1; j < kRows; ++j) last_end = max(last_end, end[j]);
  float running_max[kRows], running_sum[kRows], acc[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    running_max[j] = -INFINITY;
    running_sum[j] = 0.0f;
    acc[j] = 0.0f;
  }
  for (uint32_t chunk = begin; chunk < last_end; chunk += kChunk) {
    uint32_t count[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      count[j] = end[j] > chunk ? min(uint32_t(kChunk), end[j] - chunk) : 0;
    const uint32_t loaded = min(uint32_t(kChunk), last_end - chunk);
    // The next chunk's block table entries load while this chunk is worked on.
    const size_t next_at = chunkRow(rows, chunk + kChunk, ahead);
    float score[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) score[j] = -INFINITY;
    if (uint32_t(t) < loaded) {
      uint4 pieces[HD / 8];
      loadKeyStageValue(a, at, sh, pieces);
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (uint32_t(t) < count[j]) score[j] = scoreOf<HD>(sh.q[j], pieces, a.scale);
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const float wmax = warpMax(score[j]);
      if (t % 32 == 0) sh.warp_values[j][t / 32] = wmax;
    }
    __syncthreads();
    float alpha[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      float chunk_max = sh.warp_values[j][0];
      for (int w = 1; w < kWarps; ++w) chunk_max = fmaxf(chunk_max, sh.warp_values[j][w]);
      const float new_max = fmaxf(running_max[j], chunk_max);
      alpha[j] = expf(running_max[j] - new_max);  // 0 on the first chunk
      const float prob = uint32_t(t) < count[j] ? expf(score[j] - new_max) : 0.0f;
      sh.probs[j][t] = prob;
      score[j] = warpSum(prob);  // the warp's sum from here on
      if (count[j] > 0) running_max[j] = new_max;
    }
    __syncthreads();  // every thread has read warp_values
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (t % 32 == 0) sh.warp_values[j][t / 32] = score[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (count[j] == 0) continue;  // the same for the whole block
      float chunk_sum = 0.0f;
      for (int w = 0; w < kWarps; ++w) chunk_sum += sh.warp_values[j][w];
      running_sum[j] = fmaf(running_sum[j], alpha[j], chunk_sum);
      acc[j] *= alpha[j];
    }
    // Positions part, part + kParts, ... in order, from the staged values (the syncs above
    // follow their stores).
#pragma unroll 8
    for (uint32_t i = part; i < loaded; i += kParts) {
      const float v = sh.value(i, d);
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (i < count[j]) acc[j] = fmaf(sh.probs[j][i], v, acc[j]);
    }
    __syncthreads();  // probs, values and warp_values are rewritten by the next chunk
    at = next_at;
  }
#pragma unroll
  for (int j = 0; j < kRows; ++j) sh.partial[j][t] = acc[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    float total = 0.0f;
    if (part == 0) {
      total = sh.partial[j][d];
      for (int p = 1; p < kParts; ++p) total += sh.partial[j][p * HD + d];
    }
    out[j] = {running_max[j], running_sum[j], total};
  }
  __syncthreads();  // partial is rewritten by the next split
}

// Writes the row's output for this head from the fold of its splits, and adds the o product's
// expected sum and bound. Every thread of the block calls it.
template <int HD>
__device__ __forceinline__ void finish(const AttentionArgs& a, int r, const SplitResult& folded) {
  const int h = blockIdx.x, t = threadIdx.x, part = t / HD, d = t % HD;
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
  // The warps that hold outputs (every warp where HD is under 32: a warp must reach it whole).
  if (a.consumer.role >= 0 && (HD < 32 || part == 0)) {
    const double total = warpTotalSpread(sums);
    const int i = spreadIndex<2>();
    ProductCheck& p = a.checks.products[size_t(r) * a.checks.roles + a.consumer.role];
    if (i >= 0) atomicAdd(i == 0 ? &p.expected : &p.bound, total);
  }
}

// rope_in: what one block loads of the q/k/v kernel's inputs before the wait (biases, cos and
// sin, the bias words it folds), items q pairs [0, HD / 2), k pairs [HD / 2, HD), v elements
// [HD, 2 HD), kItems a thread; bias words q's head [0, HD / 2), the KV head's k [HD / 2, HD) and
// v [HD, 3 HD / 2), kWords a thread.
template <int HD>
struct Fresh {
  static constexpr int kItems = (2 * HD + kThreads - 1) / kThreads;
  static constexpr int kWords = (3 * HD / 2 + kThreads - 1) / kThreads;
  float bias0[kItems] = {}, bias1[kItems] = {}, c[kItems] = {}, s[kItems] = {};
  unsigned long long fold[3] = {}, words[3] = {};
};

// Item i (0 .. 2 HD) of the fresh q/k/v work: a q pair, a k pair or a v element, its index j in
// its head (the pair's first element) and the bias it adds.
struct FreshItem {
  bool is_q, is_k;
  int j;
  const __nv_bfloat16* bias;
};
template <int HD>
__device__ __forceinline__ FreshItem freshItem(const QkvArgs& q, int i) {
  constexpr int half = HD / 2;
  const bool is_q = i < half, is_k = !is_q && i < HD;
  return {is_q, is_k,
          is_q   ? i
          : is_k ? i - half
                 : i - HD,
          is_q   ? q.bias[0]
          : is_k ? q.bias[1]
                 : q.bias[2]};
}

// Every block computes its own q and its KV head's new key and value; the owner (the block of
// the row's first split) adds q's produced sums and folds q's bias words for its head, and the
// leader (the owner of the KV head's first q head) does so for k and v and writes the cache.
template <int HD>
__device__ __forceinline__ void freshLoad(const AttentionArgs& a, Fresh<HD>& f, uint32_t p, int h,
                                          int kvh, bool owner, bool leader) {
  constexpr int half = HD / 2;
  const QkvArgs& q = a.rope;
#pragma unroll
  for (int u = 0; u < Fresh<HD>::kItems; ++u) {
    const int i = int(threadIdx.x) + u * kThreads;
    if (i >= 2 * HD) break;
    const auto [is_q, is_k, j, bias] = freshItem<HD>(q, i);
    const int e = (is_q ? h : kvh) * HD + j;
    if (bias != nullptr) {
      f.bias0[u] = __bfloat162float(bias[e]);
      if (i < HD) f.bias1[u] = __bfloat162float(bias[e + half]);
    }
    if (i < HD) {
      f.c[u] = q.cos_table[size_t(p) * half + j];
      f.s[u] = q.sin_table[size_t(p) * half + j];
    }
  }
#pragma unroll
  for (int u = 0; u < Fresh<HD>::kWords; ++u) {
    const int w = int(threadIdx.x) + u * kThreads, b = w / half, j = w % half;
    if (w >= 3 * half || !(b == 0 ? owner : leader)) continue;
    const __nv_bfloat16* bias = b == 0 ? q.bias[0] : b == 1 ? q.bias[1] : q.bias[2];
    const int fold = b == 0 ? q.bias_fold[0] : b == 1 ? q.bias_fold[1] : q.bias_fold[2];
    if (bias == nullptr || fold < 0) continue;
    const uint32_t salt = b == 0 ? q.bias_salt[0] : b == 1 ? q.bias_salt[1] : q.bias_salt[2];
    const uint32_t index = uint32_t((b == 0 ? h : kvh) * half + j);
    const unsigned long long term =
        foldTerm(reinterpret_cast<const uint32_t*>(bias)[index], salt, index);
    f.fold[0] += b == 0 ? term : 0;
    f.fold[1] += b == 1 ? term : 0;
    f.fold[2] += b == 2 ? term : 0;
    f.words[0] += b == 0;
    f.words[1] += b == 1;
    f.words[2] += b == 2;
  }
}

// After the wait: the q/k/v kernel's expressions for this block's items into sh.q, sh.fresh_k
// and sh.fresh_v (the cache too, from the leader), then the sums and folds. Every thread of the
// block calls it; the caller syncs before the shared values are read.
template <int HD, int kChunks>
__device__ __forceinline__ void freshCompute(const AttentionArgs& a, const Fresh<HD>& f,
                                             Shared<HD, 1, kChunks>& sh, int r, int h, int kvh,
                                             uint32_t p, bool owner, bool leader) {
  constexpr int half = HD / 2;
  const QkvArgs& q = a.rope;
  const int q_dim = a.heads * HD, kv_dim = a.kv_heads * HD;
  const float* row = q.qkv + size_t(r) * q.stride;
  const size_t head_stride = size_t(q.block_size) * HD;
  const size_t slot = size_t(q.row_block[r]) * q.kv_heads * head_stride +
                      size_t(p % uint32_t(q.block_size)) * HD + size_t(kvh) * head_stride;
  __nv_bfloat16 *fresh_k = reinterpret_cast<__nv_bfloat16*>(sh.fresh_k),
                *fresh_v = reinterpret_cast<__nv_bfloat16*>(sh.fresh_v);
  double produced[8] = {};  // the q, k and v products' sums, then their sums of squares; 2 spare
#pragma unroll
  for (int u = 0; u < Fresh<HD>::kItems; ++u) {
    const int i = int(threadIdx.x) + u * kThreads;
    if (i >= 2 * HD) break;
    const auto [is_q, is_k, j, bias] = freshItem<HD>(q, i);
    if (i < HD) {
      const float* x = is_q ? row + h * HD : row + q_dim + kvh * HD;
      float x0 = x[j], x1 = x[j + half];
      const bool adds = is_q ? owner : leader;
      const double sum = adds ? double(x0) + double(x1) : 0.0,
                   sq = adds ? double(x0) * double(x0) + double(x1) * double(x1) : 0.0;
      produced[0] += is_q ? sum : 0.0;
      produced[1] += is_q ? 0.0 : sum;
      produced[3] += is_q ? sq : 0.0;
      produced[4] += is_q ? 0.0 : sq;
      if (bias != nullptr) {
        x0 = __fadd_rn(x0, f.bias0[u]);
        x1 = __fadd_rn(x1, f.bias1[u]);
      }
      // The q/k/v kernel's rotation (cuda/rope.cu), never contracted.
      const float r0 = __fsub_rn(__fmul_rn(x0, f.c[u]), __fmul_rn(x1, f.s[u]));
      const float r1 = __fadd_rn(__fmul_rn(x1, f.c[u]), __fmul_rn(x0, f.s[u]));
      if (is_q) {
        sh.q[0][j] = r0;
        sh.q[0][j + half] = r1;
      } else {
        const __nv_bfloat16 k0 = __float2bfloat16_rn(r0), k1 = __float2bfloat16_rn(r1);
        fresh_k[j] = k0;
        fresh_k[j + half] = k1;
        if (leader) {
          q.k_cache[slot + j] = k0;
          q.k_cache[slot + j + half] = k1;
        }
      }
    } else {
      float v = row[q_dim + kv_dim + kvh * HD + j];
      produced[2] += leader ? double(v) : 0.0;
      produced[5] += leader ? double(v) * double(v) : 0.0;
      if (bias != nullptr) v = __fadd_rn(v, f.bias0[u]);
      const __nv_bfloat16 vb = __float2bfloat16_rn(v);
      fresh_v[j] = vb;
      if (leader) q.v_cache[slot + j] = vb;
    }
  }
#pragma unroll
  for (int b = 0; b < 3; ++b) {
    const int account = b == 0 ? q.bias_fold[0] : b == 1 ? q.bias_fold[1] : q.bias_fold[2];
    if (account >= 0) addWarpFold(q.checks.folds + account, f.fold[b], f.words[b]);
  }
  if (q.product_role[0] < 0 && q.product_role[1] < 0 && q.product_role[2] < 0) return;
  const double total = warpTotalSpread(produced);
  const int i = spreadIndex<8>();
  if (i < 0 || i > 5) return;
  const int b = i % 3, role = b == 0   ? q.product_role[0]
                              : b == 1 ? q.product_role[1]
                                       : q.product_role[2];
  if (role < 0 || (b == 0 ? !owner : !leader)) return;
  ProductCheck& pc = q.checks.products[size_t(r) * q.checks.roles + role];
  atomicAdd(i < 3 ? &pc.produced : &pc.produced_sq, total);
}

// kPaired: attendRowPaired for attendRow (the same bits).
template <int HD, bool kParallel, bool kRope, bool kPaired>
__global__ void __launch_bounds__(kThreads) attentionKernel(AttentionArgs a) {
  constexpr int kChunks = kPaired ? 2 : 1;
  __shared__ Shared<HD, 1, kChunks> sh;
  __shared__ bool last;
  const int h = blockIdx.x, r = blockIdx.y, t = threadIdx.x, d = t % HD;
  const int kvh = h / (a.heads / a.kv_heads);
  // The positions and block tables are the step's inputs: read, with the first chunk's table
  // entries, before the wait for the kernel before (which writes the queries and the cache).
  const uint32_t len = a.positions[r] + 1;
  const uint32_t splits = (len + kAttentionSplit - 1) / kAttentionSplit;
  const int first = kParallel ? int(blockIdx.z) : 0, step = kParallel ? int(gridDim.z) : 1;
  const CacheRows rows{a.block_tables + a.row_table[r], size_t(kvh) * a.block_size * HD,
                       size_t(a.kv_heads) * a.block_size * HD, uint32_t(a.block_size), HD};
  auto splitEnd = [&](uint32_t s) { return min(len, (s + 1) * uint32_t(kAttentionSplit)); };
  // A split's first chunk's (and with kPaired the second's) cache rows.
  auto splitRows = [&](uint32_t s, size_t(&at)[2]) {
    at[0] = chunkRow(rows, s * kAttentionSplit, splitEnd(s));
    at[1] = kPaired ? chunkRow(rows, s * kAttentionSplit + kChunk, splitEnd(s)) : 0;
  };
  size_t first_at[2] = {};
  if (uint32_t(first) < splits) splitRows(uint32_t(first), first_at);
  const bool owner = first == 0, leader = owner && h % (a.heads / a.kv_heads) == 0;
  Fresh<HD> fresh;
  if (kRope && uint32_t(first) < splits) freshLoad<HD>(a, fresh, len - 1, h, kvh, owner, leader);
  awaitKernelBefore();
  if (uint32_t(first) >= splits) return;  // the whole block: nothing of this row is left
  if (kRope)
    freshCompute<HD, kChunks>(a, fresh, sh, r, h, kvh, len - 1, owner, leader);
  else if (t < HD)
    sh.q[0][t] = a.q[size_t(r) * a.q_stride + size_t(h) * HD + t];
  __syncthreads();
  // Split s, its cache rows looked up `ahead` from its end.
  auto attend = [&](uint32_t s, uint32_t ahead, size_t(&at)[2]) {
    if constexpr (kPaired)
      return attendRowPaired<HD, kRope>(a, rows, sh, s * kAttentionSplit, splitEnd(s), ahead, at,
                                        len - 1);
    else
      return attendRow<HD, kRope>(a, rows, sh, s * kAttentionSplit, splitEnd(s), ahead, at[0],
                                  len - 1);
  };
  if (!kParallel || splits == 1) {
    // The splits in turn: each one's last chunk looks up the next one's first.
    SplitResult folded = attend(0, len, first_at);
    for (uint32_t s = 1; s < splits; ++s) foldSplit(folded, attend(s, len, first_at));
    return finish<HD>(a, r, folded);
  }
  auto range = [&](uint32_t s) {
    size_t at[2] = {first_at[0], first_at[1]};
    if (s != uint32_t(first)) splitRows(s, at);
    return attend(s, splitEnd(s), at);
  };
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
  finish<HD>(a, r, folded);
}

// Rows of a prefill tile (AttentionArgs::tiles): up to attentionTileRows(HD) consecutive rows of
// one sequence per block, sharing each chunk's loads; each row's result as its own block would
// give it (the same attendRange, splits folded in the same order).
template <int HD>
__global__ void __launch_bounds__(kThreads) attentionTileKernel(AttentionArgs a) {
  constexpr int kRows = attentionTileRows(HD);
  __shared__ Shared<HD, kRows> sh;
  const int h = blockIdx.x, t = threadIdx.x;
  const int kvh = h / (a.heads / a.kv_heads);
  const uint32_t tile = a.tiles[blockIdx.y];
  const int first_row = int(tile & 0xffffffu), rows_here = int(tile >> 24);
  uint32_t len[kRows];
  uint32_t longest = 0;  // the tile's (its last row's)
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    len[j] = j < rows_here ? a.positions[first_row + j] + 1 : 0;
    longest = max(longest, len[j]);
  }
  const uint32_t splits = (longest + kAttentionSplit - 1) / kAttentionSplit;
  const CacheRows rows{a.block_tables + a.row_table[first_row], size_t(kvh) * a.block_size * HD,
                       size_t(a.kv_heads) * a.block_size * HD, uint32_t(a.block_size), HD};
  auto splitEnds = [&](uint32_t s, uint32_t(&end)[kRows]) {
    uint32_t last = s * kAttentionSplit;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      // A row with fewer splits has nothing in this one.
      end[j] = min(len[j], (s + 1) * uint32_t(kAttentionSplit));
      end[j] = max(end[j], s * uint32_t(kAttentionSplit));
      last = max(last, end[j]);
    }
    return last;
  };
  uint32_t end[kRows];
  size_t at = chunkRow(rows, 0, splitEnds(0, end));  // then each split's last chunk looks ahead
  awaitKernelBefore();
  for (int e = t; e < kRows * HD; e += kThreads) {
    const int j = e / HD;
    sh.q[j][e % HD] =
        j < rows_here ? a.q[size_t(first_row + j) * a.q_stride + size_t(h) * HD + e % HD] : 0.0f;
  }
  __syncthreads();
  SplitResult folded[kRows], result[kRows];
  for (uint32_t s = 0; s < splits; ++s) {
    splitEnds(s, end);
    attendTile<HD, kRows>(a, rows, sh, s * kAttentionSplit, end, longest, at, result);
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (s == 0)
        folded[j] = result[j];
      else if (end[j] > s * kAttentionSplit)
        foldSplit(folded[j], result[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kRows; ++j)
    if (j < rows_here) finish<HD>(a, first_row + j, folded[j]);
}

template <int HD, bool kRope, bool kPaired>
cudaError_t launchVariant(const AttentionArgs& a, cudaStream_t stream) {
  if (a.parallel_splits)
    return launchKernel(attentionKernel<HD, true, kRope, kPaired>,
                        dim3(unsigned(a.heads), unsigned(a.rows), unsigned(a.split_blocks)),
                        kThreads, stream, a);
  return launchKernel(attentionKernel<HD, false, kRope, kPaired>,
                      dim3(unsigned(a.heads), unsigned(a.rows)), kThreads, stream, a);
}

template <int HD, bool kRope>
cudaError_t launchPairing(const AttentionArgs& a, cudaStream_t stream) {
  if constexpr (HD <= kAttentionPairedHeads)
    if (a.paired_chunks) return launchVariant<HD, kRope, true>(a, stream);
  return launchVariant<HD, kRope, false>(a, stream);
}

template <int HD>
cudaError_t launchHeadDim(const AttentionArgs& a, cudaStream_t stream) {
  if (a.tiles != nullptr)
    return launchKernel(attentionTileKernel<HD>, dim3(unsigned(a.heads), unsigned(a.tile_count)),
                        kThreads, stream, a);
  return a.rope_in ? launchPairing<HD, true>(a, stream) : launchPairing<HD, false>(a, stream);
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
  if (a.rope_in &&
      (a.rope.qkv == nullptr || a.rope.k_cache == nullptr || a.rope.v_cache == nullptr ||
       a.rope.row_block == nullptr || a.rope.block_size != a.block_size ||
       a.rope.heads != a.heads || a.rope.kv_heads != a.kv_heads || a.rope.head_dim != a.head_dim ||
       a.rope.positions != a.positions || a.rope.k_cache != a.k_cache ||
       a.rope.v_cache != a.v_cache ||
       int64_t(a.heads + 2 * a.kv_heads) * a.head_dim > a.rope.stride))
    return invalidArgument(
        "attention with the q/k/v kernel's work: its arguments must be the "
        "attention's heads, positions, cache and block size");
  if (a.tiles != nullptr &&
      (a.parallel_splits || a.rope_in || a.paired_chunks || a.tile_count <= 0))
    return invalidArgument(
        "attention in prefill tiles needs a tile count, and neither parallel "
        "splits, the q/k/v kernel's work nor paired chunks");
  if (a.paired_chunks && a.head_dim > kAttentionPairedHeads)
    return invalidArgument("attention in paired chunks at head size " + std::to_string(a.head_dim) +
                           " (at most " + std::to_string(kAttentionPairedHeads) + ")");
  if (a.rows == 0) return okStatus();
  if (a.parallel_splits && (a.rows > kAttentionParallelRows || a.split_partials == nullptr ||
                            a.split_counts == nullptr || a.max_splits <= 0 || a.split_blocks < 2 ||
                            a.split_blocks > kAttentionSplitBlocks))
    return invalidArgument("attention with parallel splits over " + std::to_string(a.rows) +
                           " rows (at most " + std::to_string(kAttentionParallelRows) +
                           ", with partials and counts) in " + std::to_string(a.split_blocks) +
                           " blocks a row and head (2 to " + std::to_string(kAttentionSplitBlocks) +
                           ")");
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
