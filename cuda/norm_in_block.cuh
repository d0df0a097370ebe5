// The RMSNorm of rmsNormKernel (cuda/rms_norm.cu) done by one block of fewer threads, for the
// last block of a product whose output the norm adds (GemmThen, cuda/gemm.cuh): the residual
// add, the sum of squares, the normalised bf16 row, the norm weight's fold and the added
// product's produced sums. Thread t of the block takes the pairs of the kernel's threads t,
// t + kBlockThreads, ... (those of its kernel thread in the kernel's order), the warps' butterflies
// are the kernel's warps', and the total adds the kernel's 16 warps in order: the same bits as the
// kernel. Without partials or consumers (our own products check themselves).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "cuda/rms_norm.cuh"
#include "cuda/step_checks.cuh"

namespace bulkhead::cuda {

inline constexpr int kNormKernelThreads = 512;  // rms_norm.cu's block: the order reproduced here

#ifdef __CUDACC__

// Every thread of the block calls it, after the product's outputs (a.delta) are visible to it.
template <int kBlockThreads>
__device__ void normRowsInBlock(const RmsNormArgs& a, float (&warp_sums)[kNormKernelThreads / 32]) {
  static_assert(kNormKernelThreads % kBlockThreads == 0 && kBlockThreads % 32 == 0,
                "whole warps, a divisor of the kernel's threads");
  constexpr int kShares = kNormKernelThreads / kBlockThreads;
  const int t = threadIdx.x, pairs = a.hidden / 2;
  const uint32_t* weight_words = reinterpret_cast<const uint32_t*>(a.weight);
  for (int r = 0; r < a.rows; ++r) {
    float2* row = reinterpret_cast<float2*>(a.x + size_t(r) * a.hidden);
    const float2* delta = a.delta != nullptr
                              ? reinterpret_cast<const float2*>(a.delta + size_t(r) * a.hidden)
                              : nullptr;
    const int out_r = a.out_row != nullptr ? a.out_row[r] : r;  // skipped when negative
    double produced[2] = {};  // the added product's sum and sum of squares
#pragma unroll
    for (int q = 0; q < kShares; ++q) {
      // Kernel thread t + q kBlockThreads: its pairs in its order.
      float sum = 0.0f;
      for (int i = t + q * kBlockThreads; i < pairs; i += kNormKernelThreads) {
        float2 v = __ldcg(row + i);
        if (delta != nullptr) {
          const float2 d = __ldcg(delta + i);
          produced[0] += double(d.x) + double(d.y);
          produced[1] += double(d.x) * double(d.x) + double(d.y) * double(d.y);
          v.x = __fadd_rn(v.x, d.x);
          v.y = __fadd_rn(v.y, d.y);
          row[i] = v;
        }
        sum = fmaf(v.x, v.x, sum);
        sum = fmaf(v.y, v.y, sum);
      }
      for (int offset = 16; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (t % 32 == 0) warp_sums[(t + q * kBlockThreads) / 32] = sum;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < kNormKernelThreads / 32; ++w) total += warp_sums[w];
    const float inv = 1.0f / sqrtf(total / float(a.hidden) + a.eps);
    __syncthreads();  // warp_sums is the next row's
    // The pairs this thread updated above (i = t mod kBlockThreads), normalised as the kernel's
    // normalise() does.
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(a.out + size_t(out_r) * a.hidden);
    unsigned long long fold = 0;
    for (int i = t; i < pairs && out_r >= 0; i += kBlockThreads) {
      const float2 v = delta != nullptr ? row[i] : __ldcg(row + i);
      const uint32_t word = weight_words[i];
      if (a.weight_fold >= 0) fold += foldTerm(word, a.weight_salt, uint32_t(i));
      __nv_bfloat162 w;
      memcpy(&w, &word, 4);
      dst[i] = __floats2bfloat162_rn(__bfloat162float(w.x) * (v.x * inv),
                                     __bfloat162float(w.y) * (v.y * inv));
    }
    if (a.weight_fold >= 0 && out_r >= 0)
      addFold(a.checks.folds + a.weight_fold, fold, (unsigned long long)pairs);
    if (a.delta_role >= 0) {
      const double sum = warpTotalSpread(produced);
      const int i = spreadIndex<2>();
      ProductCheck& p = a.checks.products[size_t(r) * a.checks.roles + a.delta_role];
      if (i >= 0) atomicAdd(i == 0 ? &p.produced : &p.produced_sq, sum);
    }
  }
}

#endif

}  // namespace bulkhead::cuda
