// The SiLU-gated MLP activation, from the fp32 output of the fused gate/up multiply to the bf16
// input of the down projection: out[r][i] = bf16(silu(g) * u), g = gate_up[r][i],
// u = gate_up[r][inter + i], silu(g) = g / (1 + e^-g). One thread per element, the same
// operations whatever the launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "shared/status.h"

namespace bulkhead::cuda {

// gate_up: rows x (2 * inter) fp32; out: rows x inter bf16. Device memory, asynchronous.
Status launchSiluMul(const float* gate_up, int rows, int inter, __nv_bfloat16* out,
                     cudaStream_t stream);

}  // namespace bulkhead::cuda
