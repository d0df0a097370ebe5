// Rotary position embedding in the rotate-half layout, with the projection's bias added first:
// for each row r, head h and pair i < head_dim / 2 of v = x[r][h] + bias[h]:
//   v[i]        = v[i] * cos[p][i] - v[i + half] * sin[p][i]
//   v[i + half] = v[i + half] * cos[p][i] + v[i] * sin[p][i],   p = positions[r].
// The cos/sin tables are computed once on the host with the CPU engine's float arithmetic
// (ropeTables), so both backends rotate by the same values. Each element is computed by one
// thread with the same operations whatever the launch: rows are independent of each other.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "shared/status.h"

namespace bulkhead::cuda {

// cos and sin of position * inv_freq[i] for positions [0, max_context), pairs = inv_freq.size();
// row-major max_context x pairs, float32 as the CPU engine computes them.
struct RopeTables {
  std::vector<float> cos, sin;
};
RopeTables ropeTables(const std::vector<float>& inv_freq, uint32_t max_context);

// x: rows x row_stride fp32 (heads * head_dim of them are rotated, from the start of the row);
// bias: heads * head_dim fp32 or null; positions: rows uint32 (each < the tables' context);
// cos_table/sin_table: device copies of RopeTables. Device memory, asynchronous on `stream`.
Status launchBiasRope(float* x, int rows, int row_stride, int heads, int head_dim,
                      const float* bias, const uint32_t* positions, const float* cos_table,
                      const float* sin_table, cudaStream_t stream);

}  // namespace bulkhead::cuda
