// The embedding gather into the fp32 residual stream: out[r][i] = float(table[tokens[r]][i]).
// Token ids are the step's, validated against the vocabulary before any launch. The words of
// each gathered row are folded as they are loaded (the in-step check of the embedding's reads).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

// table: vocab x hidden bf16 (hidden even); tokens: rows uint32 (each < vocab); out: rows x
// hidden fp32. When `fold` is set, every word read is folded into it with `salt`, keyed by its
// index in the table. With `partials`, each row's norm tile partials too (cuda/norm_partials.cuh,
// `partials_stride` apart). Device memory, asynchronous on `stream`.
Status launchEmbedding(const __nv_bfloat16* table, int hidden, const uint32_t* tokens, int rows,
                       float* out, cudaStream_t stream, FoldAccount* fold = nullptr,
                       uint32_t salt = 0, float* partials = nullptr, int partials_stride = 0);

}  // namespace bulkhead::cuda
