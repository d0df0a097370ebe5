// The invariant tensor-core product. Per block: 16 weight rows and up to 8 * kGroups tokens; per
// warp: the k blocks of 32 numbered warp, warp + 8, ... in increasing order. Within a k block, lane
// (g, c) loads 16 bytes of weight rows g and g + 8 and of token g at k offsets 8c .. 8c + 7, and
// feeds them to two mma instructions: the k positions are permuted the same way for both
// operands, so each instruction computes a fixed part of the dot product, in a fixed order. The
// first block of each 16 rows also folds every weight word it loads (the in-step check).
#include "cuda/gemm.cuh"

#include <cstdint>
#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p, bool valid) {
  return valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
}

// kGroups groups of 8 tokens per block; kUnroll k blocks loaded together.
// The fold of the four words of a 16-byte load at word `index` of its weight.
__device__ __forceinline__ unsigned long long foldPiece(uint4 v, uint32_t salt, uint64_t index) {
  return foldTerm(v.x, salt, index) + foldTerm(v.y, salt, index + 1) +
         foldTerm(v.z, salt, index + 2) + foldTerm(v.w, salt, index + 3);
}

template <int kGroups, int kUnroll>
__global__ void __launch_bounds__(kThreads)
    gemmKernel(const __nv_bfloat16* __restrict__ x, int m, const __nv_bfloat16* __restrict__ w,
               int n, int k, float* __restrict__ y, int ldy, GemmFold fold) {
  __shared__ float partial[kWarps][16][8 * kGroups];
  __shared__ unsigned long long fold_scratch[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.x * 16, m0 = blockIdx.y * 8 * kGroups;
  const int k_blocks = (k + 31) / 32;
  const bool row_lo = n0 + g < n, row_hi = n0 + g + 8 < n;
  const __nv_bfloat16* w_lo = w + size_t(row_lo ? n0 + g : 0) * k + 8 * c;
  const __nv_bfloat16* w_hi = w + size_t(row_hi ? n0 + g + 8 : 0) * k + 8 * c;
  const __nv_bfloat16* x_row[kGroups];
  bool token[kGroups];
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    token[t] = m0 + 8 * t + g < m;
    x_row[t] = x + size_t(token[t] ? m0 + 8 * t + g : 0) * k + 8 * c;
  }
  // The first block of each 16 rows folds what it loads (one read of every word a launch).
  int segment = 0;
  while (segment + 1 < fold.weights && n0 >= fold.row_end[segment]) ++segment;
  const bool folding = fold.weights > 0 && blockIdx.y == 0;
  const int segment_begin = segment == 0 ? 0 : fold.row_end[segment - 1];
  const uint32_t salt = fold.salt[segment];
  const uint64_t row_words = uint64_t(k) / 2;
  const uint64_t lo_word = uint64_t(n0 + g - segment_begin) * row_words + 4 * c;
  const uint64_t hi_word = lo_word + 8 * row_words;
  unsigned long long folded = 0;
  float acc[kGroups][4] = {};
  for (int base = warp; base < k_blocks; base += kWarps * kUnroll) {
    uint4 a_lo[kUnroll], a_hi[kUnroll], b[kUnroll][kGroups];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kb = base + u * kWarps;
      const bool in_k = kb < k_blocks && 32 * kb + 8 * c < k;
      a_lo[u] = load16(w_lo + 32 * kb, in_k && row_lo);
      a_hi[u] = load16(w_hi + 32 * kb, in_k && row_hi);
#pragma unroll
      for (int t = 0; t < kGroups; ++t) b[u][t] = load16(x_row[t] + 32 * kb, in_k && token[t]);
    }
    if (folding) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int kb = base + u * kWarps;
        if (kb >= k_blocks || 32 * kb + 8 * c >= k) continue;
        if (row_lo) folded += foldPiece(a_lo[u], salt, lo_word + 16 * uint64_t(kb));
        if (row_hi) folded += foldPiece(a_hi[u], salt, hi_word + 16 * uint64_t(kb));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kWarps >= k_blocks) break;  // the same for the whole warp
#pragma unroll
      for (int t = 0; t < kGroups; ++t) {
        mma(acc[t], a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y, b[u][t].x, b[u][t].y);
        mma(acc[t], a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w, b[u][t].z, b[u][t].w);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    partial[warp][g][8 * t + 2 * c] = acc[t][0];
    partial[warp][g][8 * t + 2 * c + 1] = acc[t][1];
    partial[warp][g + 8][8 * t + 2 * c] = acc[t][2];
    partial[warp][g + 8][8 * t + 2 * c + 1] = acc[t][3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * 8 * kGroups; e += kThreads) {
    const int row = e % 16, col = e / 16;  // neighbouring threads store neighbouring outputs
    if (n0 + row >= n || m0 + col >= m) continue;
    float total = partial[0][row][col];
#pragma unroll
    for (int v = 1; v < kWarps; ++v) total += partial[v][row][col];
    y[size_t(m0 + col) * ldy + n0 + row] = total;
  }
  if (folding) {
    const int rows = min(16, n - n0);
    addFold(fold.account[segment], folded, (unsigned long long)(rows * row_words), fold_scratch);
  }
}

}  // namespace

Status launchGemm(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
                  int ldy, cudaStream_t stream, const GemmFold& fold) {
  if (m <= 0 || n <= 0 || k <= 0 || k % 8 != 0 || ldy < n || uintptr_t(x) % 16 != 0 ||
      uintptr_t(w) % 16 != 0)
    return invalidArgument("product of " + std::to_string(m) + "x" + std::to_string(k) + " by " +
                           std::to_string(n) + "x" + std::to_string(k) + " (k a multiple of 8, " +
                           "16-byte aligned operands)");
  if (fold.weights < 0 || fold.weights > 3 ||
      (fold.weights > 0 && fold.row_end[fold.weights - 1] != n))
    return invalidArgument("product fold over " + std::to_string(fold.weights) +
                           " weights does not end at row " + std::to_string(n));
  for (int s = 0; s + 1 < fold.weights; ++s)
    if (fold.row_end[s] % 16 != 0)
      return invalidArgument("product fold boundary at row " + std::to_string(fold.row_end[s]) +
                             " is not a multiple of 16");
  const unsigned row_blocks = unsigned((n + 15) / 16);
  auto grid = [&](int tokens_per_block) {
    return dim3(row_blocks, unsigned((m + tokens_per_block - 1) / tokens_per_block));
  };
  if (m <= 8) {
    gemmKernel<1, 4><<<grid(8), kThreads, 0, stream>>>(x, m, w, n, k, y, ldy, fold);
  } else if (m <= 16) {
    gemmKernel<2, 4><<<grid(16), kThreads, 0, stream>>>(x, m, w, n, k, y, ldy, fold);
  } else if (m <= 32) {
    gemmKernel<4, 2><<<grid(32), kThreads, 0, stream>>>(x, m, w, n, k, y, ldy, fold);
  } else {
    gemmKernel<8, 2><<<grid(64), kThreads, 0, stream>>>(x, m, w, n, k, y, ldy, fold);
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
