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

// Without checks.
Status launchSiluMul(const float* gate_up, int rows, int inter, __nv_bfloat16* out,
                     cudaStream_t stream);

#ifdef __CUDACC__
// One element of the activation, as every kernel that computes it does (the activation kernel,
// and a product whose input is the activation: the same bits).
__device__ __forceinline__ __nv_bfloat16 siluMul(float g, float u) {
  return __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
}
#endif

}  // namespace bulkhead::cuda
