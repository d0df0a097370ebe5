// Causal attention over the paged KV cache, one path for prefill chunks and decode: each token
// row attends to positions 0..positions[r] of its own sequence, read back from the cache (which
// the q/k/v kernel wrote before, in the same step). Positions go in fixed splits of
// kAttentionSplit from 0, each in fixed chunks of 128 with an online softmax whose rescaling and
// sums follow a fixed order; the splits' results are folded in split order by one formula. So a
// row's output depends only on its query and its sequence's cache: never on the batch, on how
// its prompt was chunked, on graph capture, or on whether its splits ran one after another in
// one block or side by side in several (a step of few rows over long contexts). The kernel writes
// the o projection's bf16 input, so it adds that product's expected sum and bound to the
// arithmetic check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/rope.cuh"
#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

// Positions per split. A row of at most this many positions is one split. Short enough that a
// decode step of one row at a context of 2,048 has a block for each (head, split) of its 8 splits.
constexpr int kAttentionSplit = 256;
// The most blocks per (row, head) with parallel splits (AttentionArgs::split_blocks).
constexpr int kAttentionSplitBlocks = 16;
// Steps of at most this many rows may run a row's splits side by side (parallel_splits).
constexpr int kAttentionParallelRows = 8;
// The largest head size whose rows can take their chunks in pairs (paired_chunks): both chunks'
// keys and values are held in registers at once.
constexpr int kAttentionPairedHeads = 64;
// Rows of one sequence a prefill tile holds (AttentionArgs::tiles), by head size: as many as
// the block's shared memory holds beside a chunk of value rows.
BULKHEAD_HOST_DEVICE constexpr int attentionTileRows(int head_dim) {
  return head_dim >= 128 ? 4 : 8;
}

// What both attention kernels (this one and cuda/attention_mma.cuh's) are given.
struct AttentionInputs {
  const float* q = nullptr;  // rows x q_stride fp32, the rotated queries at the start of a row
  int q_stride = 0;
  int rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  const uint32_t* positions = nullptr;  // rows
  const uint32_t* row_table = nullptr;  // rows: where the row's block table starts
  const uint32_t* block_tables = nullptr;
  const __nv_bfloat16* k_cache = nullptr;  // this layer's, [block][kv_head][slot][head_dim]
  const __nv_bfloat16* v_cache = nullptr;
  int block_size = 0;
  float scale = 1.0f;
  __nv_bfloat16* out = nullptr;  // rows x heads * head_dim
  ConsumerSums consumer;         // the o projection
  CheckView checks;
  // Where splits run side by side, the last block to finish folds the others' results: the
  // partials hold rows x heads x max_splits x (head_dim + 2) floats; the counts must be zero
  // before the launch and are left zero after it.
  float* split_partials = nullptr;
  unsigned* split_counts = nullptr;
  int max_splits = 0;  // the most splits a row may have (positions[r] < max_splits * split)
};

// head_dim 16, 32, 64 or 128.
struct AttentionArgs : AttentionInputs {
  // Splits side by side, each row's over blocks of its own (counts: rows x heads), the last to
  // finish folding them (the same bits as one after another): for steps of at most
  // kAttentionParallelRows rows.
  bool parallel_splits = false;
  // With parallel_splits: blocks a (row, head), 2 to kAttentionSplitBlocks, block z taking
  // splits z, z + split_blocks, ... (a grid no wider than the step's longest row needs).
  int split_blocks = kAttentionSplitBlocks;
  // Each block takes its chunks two at a time (head sizes up to kAttentionPairedHeads; not with
  // tiles): both chunks' keys and values load together and cross the block's barriers together,
  // each chunk's arithmetic as alone and in the same order, so the same bits.
  bool paired_chunks = false;
  // The q/k/v kernel's work done here instead (rope_in): for steps whose every row is its
  // sequence's only row (decode steps), where no row attends to another's new key. Each block
  // adds its head's biases and rotates its q from the product's raw output (rope.qkv, which q
  // then points into), computes its KV head's new key and value for the row's own position
  // (used from shared memory, the same bf16 values the cache gets), and the first block of each
  // KV head writes them to the cache; the products' produced sums and the bias folds are added
  // once a row as the q/k/v kernel adds them. The same bits as that kernel then this one.
  bool rope_in = false;
  QkvArgs rope = {};
  // Prefill tiles instead of a block per row (not with parallel_splits or rope_in): entry i is
  // a tile's first row | its row count << 24, the rows consecutive positions of one sequence,
  // at most attentionTileRows(head_dim) of them; every row in exactly one tile.
  const uint32_t* tiles = nullptr;
  int tile_count = 0;
};

// Whether the kernel supports this head size.
bool attentionSupportsHeadDim(int head_dim);

// Device memory, asynchronous on `stream`.
Status launchAttention(const AttentionArgs& args, cudaStream_t stream);

}  // namespace bulkhead::cuda
