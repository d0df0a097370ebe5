// Causal attention on the tensor cores (CudaBackend::Options::attention_mma): the design in
// cuda/PERFORMANCE.md ("Attention on the tensor cores"), first checked by
// tools/gpu/attention_mma_probe.cu. A tile is rows of one sequence against one KV head; its items
// are (row, q head) pairs, the rows' heads of that KV group in turn, 16 to a warp, 64 to a block.
// A warp scores its 16 items against each chunk of 64 key positions with mma.sync (bf16 queries
// and keys, fp32 sums in fixed k16 steps), keeps an online softmax per item (each item's maximum
// exact in any order; its probabilities rounded to bf16 once and summed a thread's 16 in
// position order, then over the quad by xor 1 and 2), and multiplies the probabilities by the
// values with mma.sync. Positions go in splits of kAttentionSplit from 0, each split's online
// softmax starting afresh; the splits fold in split order by the formula cuda/attention.cu
// uses, whether one block ran them one after another or several side by side. An item's output
// therefore depends only on its query, its sequence's cache and its position: never on the other
// items of its warp, the tile's rows, the batch, the chunking of its prompt or graph capture.
// A block loads the next chunk's keys and values (cp.async) while its warps compute on this one's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.cuh"
#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

// Items a block holds: four warps of 16.
constexpr int kMmaTileItems = 64;

// head_dim 64 or 128.
struct MmaAttentionArgs : AttentionInputs {
  // Tile i: tiles[2 i] = its first row | its row count << 24 (rows of one sequence, count x the
  // group's heads at most kMmaTileItems), tiles[2 i + 1] = its KV head.
  const uint32_t* tiles = nullptr;
  int tile_count = 0;
  // Splits side by side: split_blocks blocks a tile, block z taking splits z, z + split_blocks,
  // ..., each split's result to the partials; the block that completes a tile's last split folds
  // them in split order (counts: a tile each). 1: one block a tile.
  int split_blocks = 1;
};

// Whether the kernel supports this head size.
bool mmaAttentionSupportsHeadDim(int head_dim);

// Device memory, asynchronous on `stream`.
Status launchMmaAttention(const MmaAttentionArgs& args, cudaStream_t stream);

}  // namespace bulkhead::cuda
