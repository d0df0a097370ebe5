// Matmul: workspace-0 cuBLAS, bf16 x bf16 -> fp32.
#include "cuda/matmul.cuh"

#include <string>

namespace bulkhead::cuda {
namespace {

Status cublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return okStatus();
  return internalError(std::string(what) + " failed: " + cublasGetStatusName(s) + " (" +
                       cublasGetStatusString(s) + ")");
}

}  // namespace

Result<std::unique_ptr<Matmul>> Matmul::create(cudaStream_t stream) {
  std::unique_ptr<Matmul> m(new Matmul());
  BULKHEAD_RETURN_IF_ERROR(cublasStatus(cublasCreate(&m->handle_), "cublasCreate"));
  BULKHEAD_RETURN_IF_ERROR(cublasStatus(cublasSetStream(m->handle_, stream), "cublasSetStream"));
  // No workspace: no split-K whose combination order could depend on the row count.
  BULKHEAD_RETURN_IF_ERROR(
      cublasStatus(cublasSetWorkspace(m->handle_, nullptr, 0), "cublasSetWorkspace"));
  BULKHEAD_RETURN_IF_ERROR(
      cublasStatus(cublasSetMathMode(m->handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  Result<std::unique_ptr<Matmul>> created(std::move(m));  // nvcc does not move `m` implicitly
  return created;
}

Matmul::~Matmul() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

Status Matmul::run(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
                   bool accumulate) const {
  if (m <= 0 || n <= 0 || k <= 0)
    return invalidArgument("matmul of " + std::to_string(m) + "x" + std::to_string(k) + " by " +
                           std::to_string(n) + "x" + std::to_string(k));
  // In cuBLAS's column-major terms: w (row-major n x k) is a k x n matrix, used transposed; x
  // (row-major m x k) is k x m; the n x m result is y row-major m x n.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return cublasStatus(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w,
                                   CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, y, CUDA_R_32F, n,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                      "cublasGemmEx");
}

}  // namespace bulkhead::cuda
