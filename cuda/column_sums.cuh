// The column sums of a bf16 weight matrix, for the arithmetic check of its products
// (cuda/step_checks.cuh): colsum[k] = sum_j w[j][k] and abssum[k] = scale * sum_j |w[j][k]|,
// each summed in double in a fixed order (chunks of rows, then the chunks in order), stored as
// float.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "shared/status.h"

namespace bulkhead::cuda {

// w: rows x cols bf16; colsum, abssum: cols floats. Device memory, on `stream`; returns once
// the sums are written.
Status launchColumnSums(const __nv_bfloat16* w, int rows, int cols, double scale, float* colsum,
                        float* abssum, cudaStream_t stream);

}  // namespace bulkhead::cuda
