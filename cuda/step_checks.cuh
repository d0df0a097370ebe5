// The in-step checks the CUDA kernels fill as they work (DESIGN.md, "Integrity"): for every
// matrix multiply and every token row, the arithmetic check's three numbers, and for every weight
// our own kernels load (embedding, norms, biases), the folded words. The kernels that read a
// product's input and output anyway add to them; the host compares at the end of the step.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shared/mix.h"
#include "shared/status.h"

namespace bulkhead::cuda {

// One product's check for one token row: produced = the sum of the outputs; expected = the
// weight's column sums dotted with the input; bound = how far they may differ by float rounding
// at worst (the column sums of |w| dotted with |input|, times the accumulation bound per unit);
// produced_sq = the sum of the outputs' squares, the scale of how far they differ by rounding in
// practice. Summed in double, by atomic adds in any order, so the check's own rounding is
// negligible beside the product's.
struct ProductCheck {
  double produced;
  double expected;
  double bound;
  double produced_sq;
};

// How far a product's check may differ by rounding in practice, per role (its k): `spread` times
// (sqrt(produced_sq) + |produced|), plus `colsum` times the bound (the column sums' own rounding
// to float). A worst-case bound grows with k times the number of outputs and lets a single wrong
// output of ordinary size through on wide products; this one grows with the accumulation's
// length times the outputs' magnitude.
struct ProductScale {
  double spread = 0;
  double colsum = 0;
};

// One weight's folded reads in one step: the sum of foldWordTerm(word, salt, index) over the
// words loaded, and how many. A launch's blocks add into kFoldSlots slots (a block's slot from its
// index, each slot a 32-byte sector of its own) rather than all into one address, where their
// atomic adds would wait for one another; integer sums modulo 2^64, so the slots add up to the
// same totals in any order.
inline constexpr int kFoldSlots = 8;
struct FoldSlot {
  unsigned long long sum;
  unsigned long long words;
  unsigned long long unused[2];
};
struct FoldAccount {
  FoldSlot slots[kFoldSlots];
  BULKHEAD_HOST_DEVICE unsigned long long sum() const {
    unsigned long long total = 0;
    for (const FoldSlot& s : slots) total += s.sum;
    return total;
  }
  BULKHEAD_HOST_DEVICE unsigned long long words() const {
    unsigned long long total = 0;
    for (const FoldSlot& s : slots) total += s.words;
    return total;
  }
#ifdef __CUDACC__
  // The calling block's slot (the linear block index modulo kFoldSlots).
  __device__ FoldSlot& mine() {
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return slots[block % kFoldSlots];
  }
#endif
};

// Where a kernel adds its part of the checks. products is [row][role], `roles` per row.
struct CheckView {
  ProductCheck* products = nullptr;
  int roles = 0;
  FoldAccount* folds = nullptr;
};

// A product that consumes a bf16 input a kernel writes: its role and the weight's column sums.
struct ConsumerSums {
  int role = -1;                  // -1: none
  const float* colsum = nullptr;  // sum_j w[j][k]
  const float* abssum = nullptr;  // sum_j |w[j][k]|, times the bound's unit
};

#ifdef __CUDACC__

// Sums N doubles over the warp (N a power of two, at most 32) and returns one total a lane: lane l
// gets value l / (32 / N)'s. The first log2(N) steps trade halves (a lane keeps half its values and
// sends its partner the other half), so that every shuffle carries a value still needed: N - 1 +
// 5 - log2(N) shuffles instead of 5 N. Every lane of the warp must reach it. The checks add each
// total to its destination from the first lane that holds it (spreadIndex): atomic adds from
// several lanes at once, no barrier on the kernel's path, and a block's warps finish
// independently.
template <int N>
__device__ __forceinline__ double warpTotalSpread(const double (&in)[N]) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two, at most 32");
  double v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = in[i];
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int count = N, offset = 16; count > 1; count /= 2, offset /= 2) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < count / 2; ++i) {
      const double send = upper ? v[i] : v[i + count / 2];
      const double keep = upper ? v[i + count / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  double total = v[0];
#pragma unroll
  for (int offset = 16 / N; offset > 0; offset /= 2)
    total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}

// After warpTotalSpread<N>: the index of the value whose total this lane adds to its destination,
// or -1 for the lanes that hold a copy of one.
template <int N>
__device__ __forceinline__ int spreadIndex() {
  constexpr int kGroup = 32 / N;
  const int lane = threadIdx.x % 32;
  return lane % kGroup == 0 ? lane / kGroup : -1;
}

// The warp's sum of 64-bit words modulo 2^64, in every lane: three 32-bit reductions (redux.sync)
// instead of five 64-bit shuffles and adds. The high halves may wrap (only their low 32 bits
// reach the result); the low halves are summed as two 16-bit halves, which cannot overflow.
__device__ __forceinline__ unsigned long long warpSum64(unsigned long long x) {
  const uint32_t hi = uint32_t(x >> 32), lo = uint32_t(x);
  const unsigned long long h = __reduce_add_sync(0xffffffffu, hi);
  const unsigned long long l0 = __reduce_add_sync(0xffffffffu, lo & 0xffffu);
  const unsigned long long l1 = __reduce_add_sync(0xffffffffu, lo >> 16);
  return (h << 32) + (l1 << 16) + l0;
}

// After warpTotalSpread<N> in every warp of the block: value i's total over the block in thread
// i (i < N; the warps' totals added in warp order), 0 in the other threads. A block of W warps
// then adds each total once instead of W times, so that W times fewer atomic adds wait on one
// address. `scratch`: N doubles a warp, in shared memory. Every thread of the block must reach it
// (a barrier).
template <int N>
__device__ __forceinline__ double blockTotal(double warp_total, double* scratch) {
  const int i = spreadIndex<N>(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (i >= 0) scratch[warp * N + i] = warp_total;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x < N)
    for (int w = 0; w < warps; ++w) total += scratch[w * N + threadIdx.x];
  return total;
}

// Sums N doubles over the block at once, each by a fixed tree; every thread gets the totals in v.
// `scratch` holds N * blockDim.x / 32 doubles. Callers must reach it uniformly.
template <int N>
__device__ inline void blockSums(double (&v)[N], double* scratch) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    for (int offset = 16; offset > 0; offset /= 2)
      v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i * warps + warp] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    double total = 0.0;
    for (int w = 0; w < warps; ++w) total += scratch[i * warps + w];
    v[i] = total;
  }
}

// The fold of one 32-bit weight word at `index` (shared/checksum.h foldWeightRow).
__device__ inline unsigned long long foldTerm(uint32_t word, uint32_t salt, uint32_t index) {
  return foldWordTerm(word, salt, index);
}

// Adds a block's folded words to a weight's account: each warp its sum, thread 0 the block's
// word count. Every lane of every warp must reach it; no barrier.
__device__ inline void addFold(FoldAccount* account, unsigned long long sum,
                               unsigned long long words) {
  sum = warpSum64(sum);
  FoldSlot& slot = account->mine();
  if (threadIdx.x % 32 == 0) atomicAdd(&slot.sum, sum);
  if (threadIdx.x == 0) atomicAdd(&slot.words, words);
}

// Adds each lane's folded words and their count (at most 2^27 a lane) to a weight's account, a
// warp's at once (lanes that folded nothing add zeros). Every lane of the warp must reach it; no
// barrier.
__device__ inline void addWarpFold(FoldAccount* account, unsigned long long sum,
                                   unsigned long long words) {
  sum = warpSum64(sum);
  const unsigned warp_words = __reduce_add_sync(0xffffffffu, unsigned(words));
  if (threadIdx.x % 32 == 0 && warp_words > 0) {
    FoldSlot& slot = account->mine();
    atomicAdd(&slot.sum, sum);
    atomicAdd(&slot.words, (unsigned long long)warp_words);
  }
}

// N weights' folded words and their counts added over the block (each lane's count at most 2^27),
// then one atomic add each into its account from thread b of the block (b < N; accounts[b] null
// or count zero: none). `scratch`: 2 N words a warp, in shared memory. Every thread of the block
// must reach it (a barrier).
template <int N>
__device__ inline void addBlockFolds(FoldAccount* const (&accounts)[N],
                                     const unsigned long long (&sums)[N],
                                     const unsigned long long (&words)[N],
                                     unsigned long long* scratch) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int b = 0; b < N; ++b) {
    const unsigned long long sum = warpSum64(sums[b]);
    const unsigned warp_words = __reduce_add_sync(0xffffffffu, unsigned(words[b]));
    if (threadIdx.x % 32 == 0) {
      scratch[(warp * N + b) * 2] = sum;
      scratch[(warp * N + b) * 2 + 1] = warp_words;
    }
  }
  __syncthreads();
  const int b = int(threadIdx.x);
  FoldAccount* account = nullptr;  // accounts[b] by selects, not an index into the parameters
#pragma unroll
  for (int i = 0; i < N; ++i) account = i == b ? accounts[i] : account;
  if (account == nullptr) return;
  unsigned long long sum = 0, count = 0;
  for (int w = 0; w < warps; ++w) {
    sum += scratch[(w * N + b) * 2];
    count += scratch[(w * N + b) * 2 + 1];
  }
  if (count == 0) return;
  FoldSlot& slot = account->mine();
  atomicAdd(&slot.sum, sum);
  atomicAdd(&slot.words, count);
}

#endif

// Where a step's product checks are counted, per role (device memory, zeroed before): failed,
// those whose |produced - expected| exceeds bound (NaN fails too); strayed, those within the
// bound that exceed what rounding does in practice (ProductScale); checked, those that had any
// input at all.
struct ProductCounts {
  unsigned int* failed = nullptr;
  unsigned int* strayed = nullptr;
  unsigned int* checked = nullptr;
};

// A weight's folded reads in one step, its account's slots added up.
struct FoldTotal {
  unsigned long long sum;
  unsigned long long words;
};

// After a step: counts the `rows` x roles product checks into `counts`, and zeroes them for the
// next step; and adds up each of the `fold_count` accounts' slots into fold_totals (so that the
// host reads 16 bytes a weight, not the slots).
Status launchCountFailedProducts(ProductCheck* products, int rows, int roles,
                                 const ProductScale* scales, ProductCounts counts,
                                 const FoldAccount* folds, int fold_count, FoldTotal* fold_totals,
                                 cudaStream_t stream);

// Fault injection (a faulty multiplier): flips the highest exponent bit of y[index].
Status launchFlipExponentBit(float* y, size_t index, cudaStream_t stream);

}  // namespace bulkhead::cuda
