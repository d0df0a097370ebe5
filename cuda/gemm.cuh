// Our matrix multiply for every product of a step: y[m][n] = sum_k x[m][k] * w[n][k], bf16 in,
// fp32 out, on the tensor cores (mma.sync m16n8k16). A row's result is the same whatever the
// number of rows, by construction rather than by observation: each output element is one fixed
// sequence of operations that depends on the shape (n, k) alone. The weight rows go on the
// instruction's 16-row side and the tokens on its 8-column side, so a decode step of one token
// wastes only token columns, not weight bandwidth; k is split over the warps of a cluster of
// blocks in a fixed interleave (gemmSplits blocks, from the shape alone) and their sums are added
// in a fixed order. Any number of rows, any n, k a multiple of 8; x, w 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

// The in-step check of the weight words a product loads: every word is folded (step_checks.cuh
// foldTerm, keyed by the weight's salt and the word's index in its weight) into its weight's
// account, once per launch. w may hold up to three weights one after another (fused q/k/v,
// gate/up): weight s has rows [row_end[s - 1], row_end[s]), each boundary a multiple of 16.
struct GemmFold {
  int weights = 0;  // 0: nothing is folded
  FoldAccount* account[3] = {};
  uint32_t salt[3] = {};
  int row_end[3] = {};
};

// How many blocks share each 16 weight rows' k blocks, from the weight's shape alone: enough
// blocks to keep the GPU's memory busy on a small weight, without splitting a long row thinner
// than 32 k blocks a block.
int gemmSplits(int n, int k);

// x: m x k row-major; w: n x k row-major (a checkpoint's linear layer); y: m rows of n floats,
// `ldy` apart. Device memory, asynchronous on `stream`.
Status launchGemm(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
                  int ldy, cudaStream_t stream, const GemmFold& fold = {});

}  // namespace bulkhead::cuda
