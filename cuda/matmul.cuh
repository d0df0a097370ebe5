// cuBLAS, the reference our product (cuda/gemm.cuh) is tested against: y = x · wᵀ with bf16
// inputs, fp32 accumulation and an fp32 output, with no workspace. With a workspace cuBLAS may
// split K and combine the splits in an order that depends on the number of rows, so a row's result
// changes with the batch; with none, every row came out bit-identical for every row count on the
// model shapes measured (GPU-NOTES.md). That is an observation about one library version, so the
// GPU tests (tests/gpu/matmul_gpu_test.cpp) are the judge, on every build.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>

#include "shared/status.h"

namespace bulkhead::cuda {

class Matmul {
 public:
  // A cuBLAS handle bound to `stream`, with no workspace.
  static Result<std::unique_ptr<Matmul>> create(cudaStream_t stream);
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // y[m x n] = x[m x k] · w[n x k]ᵀ (+ y when accumulate), every matrix row-major in device
  // memory (w as a checkpoint stores a linear layer: one row per output). Asynchronous on the
  // stream.
  Status run(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
             bool accumulate) const;

 private:
  Matmul() = default;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace bulkhead::cuda
