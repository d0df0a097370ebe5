// RMSNorm of the fp32 residual stream into the bf16 input of the next matrix multiply, with the
// residual add before it: x[r] += delta[r] (the previous product's output), then
// out[r][i] = bf16(weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps))). One block per row with
// a fixed thread count and a fixed reduction tree, so a row's result depends only on the row:
// never on how many rows are normalised together. Since it reads the previous product's output
// and writes the next products' input, it also adds both sides of their arithmetic checks, and
// folds the norm weight's words as it loads them (cuda/step_checks.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

constexpr int kMaxNormConsumers = 3;

struct RmsNormArgs {
  float* x = nullptr;            // rows x hidden fp32; updated in place when delta is given
  const float* delta = nullptr;  // rows x hidden, added to x first; null: none
  int delta_role = -1;           // the product delta came from (its produced sums); -1: none
  // With partials (cuda/norm_partials.cuh), x is already the residual sum, written with these
  // (normTiles(hidden) a row, `partials_stride` apart) by the embedding or a product's residual
  // epilogue: the row's sum of squares is theirs, added up in a fixed order, and delta must be
  // null. Without, the kernel reduces the row itself.
  const float* partials = nullptr;
  int partials_stride = 0;
  int rows = 0;
  int hidden = 0;  // even
  const __nv_bfloat16* weight = nullptr;
  uint32_t weight_salt = 0;
  int weight_fold = -1;  // the weight's FoldAccount; -1: not folded
  float eps = 1e-6f;
  __nv_bfloat16* out = nullptr;  // normalised rows, bf16
  // Row r is normalised into out row out_row[r] and skipped when that is negative (the final
  // norm of the rows whose logits were asked for); null: into row r. The consumers' checks are
  // kept by out row.
  const int* out_row = nullptr;
  ConsumerSums consumers[kMaxNormConsumers];  // filled from the first
  CheckView checks;
};

// The widest row the norm takes (a block's threads hold the row in registers).
inline constexpr int kMaxNormHidden = 8192;

// Device memory, asynchronous on `stream`.
Status launchRmsNorm(const RmsNormArgs& args, cudaStream_t stream);

// The plain norm: x rows x hidden fp32, weight hidden bf16, out rows x hidden bf16.
Status launchRmsNorm(const float* x, int rows, int hidden, const __nv_bfloat16* weight, float eps,
                     __nv_bfloat16* out, cudaStream_t stream);

}  // namespace bulkhead::cuda
