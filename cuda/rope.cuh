// The attention's inputs from the fused q/k/v product: the projections' biases added, RoPE in the
// rotate-half layout applied to q and k, and k and v written into the paged KV cache (bf16). For
// each row r, head h and pair i < head_dim / 2 of u = x[r][h] + bias[h]:
//   u[i]        = u[i] * cos[p][i] - u[i + half] * sin[p][i]
//   u[i + half] = u[i + half] * cos[p][i] + u[i] * sin[p][i],   p = positions[r].
// The cos/sin tables are computed once on the host with the CPU engine's float arithmetic
// (ropeTables), so both backends rotate by the same values. Each element by one fixed sequence of
// operations: rows are independent of each other. The kernel reads the products' outputs, so it
// adds their produced sums to the arithmetic checks, and it folds the bias words (each once a
// row, spread over the row's threads).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

// cos and sin of position * inv_freq[i] for positions [0, max_context), pairs = inv_freq.size();
// row-major max_context x pairs, float32 as the CPU engine computes them.
struct RopeTables {
  std::vector<float> cos, sin;
};
RopeTables ropeTables(const std::vector<float>& inv_freq, uint32_t max_context);

struct QkvArgs {
  // rows x stride fp32: q (heads * head_dim), then k and v (kv_heads * head_dim each). q is
  // rotated in place; k and v go to the cache.
  float* qkv = nullptr;
  int rows = 0, stride = 0, heads = 0, kv_heads = 0, head_dim = 0;
  const __nv_bfloat16* bias[3] = {};  // q, k, v biases (bf16, as the checkpoint stores them)
  uint32_t bias_salt[3] = {};
  int bias_fold[3] = {-1, -1, -1};
  int product_role[3] = {-1, -1, -1};   // the q, k, v products (their produced sums)
  const uint32_t* positions = nullptr;  // rows, each < the tables' context
  const float* cos_table = nullptr;     // device copies of RopeTables
  const float* sin_table = nullptr;
  // This layer's cache, [block][kv_head][slot][head_dim]; row r goes to block row_block[r],
  // slot positions[r] % block_size. Null k_cache: nothing is written (k stays in qkv, rotated).
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
  const uint32_t* row_block = nullptr;
  int block_size = 0;
  CheckView checks;
};

// Device memory, asynchronous on `stream`.
Status launchQkv(const QkvArgs& args, cudaStream_t stream);

}  // namespace bulkhead::cuda
