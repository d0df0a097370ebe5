// The embedding gather into the fp32 residual stream: out[r][i] = float(table[tokens[r]][i]).
// Token ids are the step's, validated against the vocabulary before any launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "shared/status.h"

namespace bulkhead::cuda {

// table: vocab x hidden bf16; tokens: rows uint32 (each < vocab); out: rows x hidden fp32.
// Device memory, asynchronous on `stream`.
Status launchEmbedding(const __nv_bfloat16* table, int hidden, const uint32_t* tokens, int rows,
                       float* out, cudaStream_t stream);

}  // namespace bulkhead::cuda
