// Causal attention over the paged KV cache, one path for prefill chunks and decode: each token
// row attends to positions 0..positions[r] of its own sequence, read back from the cache (which
// the q/k/v kernel wrote before, in the same step). Positions go in fixed chunks of 128 from 0,
// with an online softmax whose rescaling and sums follow a fixed order, so a row's output
// depends only on its query and its sequence's cache: never on the batch, on how its prompt was
// chunked, or on graph capture. The kernel writes the o projection's bf16 input, so it adds that
// product's expected sum and bound to the arithmetic check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

struct AttentionArgs {
  const float* q = nullptr;  // rows x q_stride fp32, the rotated queries at the start of a row
  int q_stride = 0;
  int rows = 0, heads = 0, kv_heads = 0, head_dim = 0;  // head_dim 16, 32, 64 or 128
  const uint32_t* positions = nullptr;                  // rows
  const uint32_t* row_table = nullptr;                  // rows: where the row's block table starts
  const uint32_t* block_tables = nullptr;
  const __nv_bfloat16* k_cache = nullptr;  // this layer's, [block][kv_head][slot][head_dim]
  const __nv_bfloat16* v_cache = nullptr;
  int block_size = 0;
  float scale = 1.0f;
  __nv_bfloat16* out = nullptr;  // rows x heads * head_dim
  ConsumerSums consumer;         // the o projection
  CheckView checks;
};

// Whether the kernel supports this head size.
bool attentionSupportsHeadDim(int head_dim);

// Device memory, asynchronous on `stream`.
Status launchAttention(const AttentionArgs& args, cudaStream_t stream);

}  // namespace bulkhead::cuda
