// The SiLU-gated MLP activation, from the fp32 output of the fused gate/up multiply to the bf16
// input of the down projection: out[r][i] = bf16(silu(g) * u), g = gate_up[r][i],
// u = gate_up[r][inter + i], silu(g) = g / (1 + e^-g). Each element by the same operations
// whatever the launch. It reads the gate and up products' outputs and writes the
// down product's input, so it adds to all three arithmetic checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

struct SiluMulArgs {
  const float* gate_up = nullptr;  // rows x (2 * inter) fp32
  int rows = 0, inter = 0;
  __nv_bfloat16* out = nullptr;  // rows x inter bf16
  int gate_role = -1, up_role = -1;
  ConsumerSums down;
  CheckView checks;
};

// Device memory, asynchronous on `stream`.
Status launchSiluMul(const SiluMulArgs& args, cudaStream_t stream);

#ifdef __CUDACC__

// One element of the activation, as every kernel computes it.
__device__ __forceinline__ __nv_bfloat16 siluMul(float g, float u) {
  return __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
}

// Columns j0 .. j0 + 15 of every row (at most 8) by one block of 128 threads, a thread an
// element, with the checks' sums siluMulKernel adds: for the last block of the gate/up product
// to store either of those columns' gate or up outputs (cuda/gemm.cuh GemmThen). The outputs
// are read from the L2 cache (written by other blocks of the same launch).
__device__ __forceinline__ void siluColumnsInBlock(const SiluMulArgs& a, int j0) {
  const int r = int(threadIdx.x) / 16, j = j0 + int(threadIdx.x) % 16;
  const bool in = r < a.rows && j < a.inter;
  double sums[6] = {};  // gate and up (sums, sums of squares), the down product's expected, bound
  if (in) {
    const float* gate = a.gate_up + size_t(r) * 2 * a.inter;
    const float g = __ldcg(gate + j), u = __ldcg(gate + a.inter + j);
    const __nv_bfloat16 o = siluMul(g, u);
    a.out[size_t(r) * a.inter + j] = o;
    const float of = __bfloat162float(o);
    sums[0] = double(g);
    sums[1] = double(u);
    sums[2] = double(g) * double(g);
    sums[3] = double(u) * double(u);
    if (a.down.role >= 0) {
      sums[4] = double(a.down.colsum[j]) * of;
      sums[5] = double(a.down.abssum[j]) * fabsf(of);
    }
  }
  if (a.gate_role < 0 && a.up_role < 0 && a.down.role < 0) return;
    // Over the row's 16 threads (half a warp), then six atomic adds from its first.
#pragma unroll
  for (int i = 0; i < 6; ++i)
    for (int offset = 8; offset > 0; offset /= 2)
      sums[i] += __shfl_xor_sync(0xffffffffu, sums[i], offset);
  if (!in || threadIdx.x % 16 != 0) return;
  ProductCheck* row = a.checks.products + size_t(r) * a.checks.roles;
  for (int i = 0; i < 6; ++i) {
    const int role = i == 0 || i == 2 ? a.gate_role : i == 1 || i == 3 ? a.up_role : a.down.role;
    if (role >= 0)
      atomicAdd(i < 2    ? &row[role].produced
                : i < 4  ? &row[role].produced_sq
                : i == 4 ? &row[role].expected
                         : &row[role].bound,
                sums[i]);
  }
}

#endif

// Without checks.
Status launchSiluMul(const float* gate_up, int rows, int inter, __nv_bfloat16* out,
                     cudaStream_t stream);

}  // namespace bulkhead::cuda
