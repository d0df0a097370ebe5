// RMSNorm of the fp32 residual stream into the bf16 input of the next matrix multiply:
// out[r][i] = bf16(weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps))). One block per row with
// a fixed thread count and a fixed reduction tree, so a row's result depends only on the row:
// never on how many rows are normalised together. (The residual add that precedes a norm is
// fused into the matrix multiply that produces it: Matmul accumulates into the stream.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "shared/status.h"

namespace bulkhead::cuda {

// x: rows x hidden fp32, weight: hidden bf16, out: rows x hidden bf16; device memory,
// asynchronous on `stream`.
Status launchRmsNorm(const float* x, int rows, int hidden, const __nv_bfloat16* weight, float eps,
                     __nv_bfloat16* out, cudaStream_t stream);

}  // namespace bulkhead::cuda
