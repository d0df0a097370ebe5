// Column sums: one thread per column, walking the rows in order (coalesced across the warp).
#include "cuda/column_sums.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

__global__ void columnSumsKernel(const __nv_bfloat16* w, int rows, int cols, double scale,
                                 float* colsum, float* abssum) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  double sum = 0.0, abs_sum = 0.0;
  for (int j = 0; j < rows; ++j) {
    const double v = __bfloat162float(w[size_t(j) * cols + c]);
    sum += v;
    abs_sum += fabs(v);
  }
  colsum[c] = float(sum);
  abssum[c] = float(abs_sum * scale);
}

}  // namespace

Status launchColumnSums(const __nv_bfloat16* w, int rows, int cols, double scale, float* colsum,
                        float* abssum, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0)
    return invalidArgument("column sums of " + std::to_string(rows) + "x" + std::to_string(cols));
  constexpr int kThreads = 128;
  columnSumsKernel<<<(cols + kThreads - 1) / kThreads, kThreads, 0, stream>>>(w, rows, cols, scale,
                                                                              colsum, abssum);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
