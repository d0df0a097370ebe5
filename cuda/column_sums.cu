// Column sums in two passes, in a fixed order: each block sums 256 rows of 128 columns (one
// thread a column, rows in order) into a partial; then one thread a column adds the partials in
// row order. The first pass spreads over the whole device (one thread a column alone would walk
// lm_head's 152k rows serially: 145 ms a weight on an H200, seconds per worker start).
#include "cuda/column_sums.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/resources.h"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerChunk = 256;

__global__ void partialSumsKernel(const __nv_bfloat16* w, int rows, int cols, double* sums,
                                  double* abs_sums) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int first = blockIdx.y * kRowsPerChunk, last = min(rows, first + kRowsPerChunk);
  double sum = 0.0, abs_sum = 0.0;
  for (int j = first; j < last; ++j) {
    const double v = __bfloat162float(w[size_t(j) * cols + c]);
    sum += v;
    abs_sum += fabs(v);
  }
  sums[size_t(blockIdx.y) * cols + c] = sum;
  abs_sums[size_t(blockIdx.y) * cols + c] = abs_sum;
}

__global__ void totalSumsKernel(const double* sums, const double* abs_sums, int chunks, int cols,
                                double scale, float* colsum, float* abssum) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  double sum = 0.0, abs_sum = 0.0;
  for (int i = 0; i < chunks; ++i) {
    sum += sums[size_t(i) * cols + c];
    abs_sum += abs_sums[size_t(i) * cols + c];
  }
  colsum[c] = float(sum);
  abssum[c] = float(abs_sum * scale);
}

}  // namespace

Status launchColumnSums(const __nv_bfloat16* w, int rows, int cols, double scale, float* colsum,
                        float* abssum, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0)
    return invalidArgument("column sums of " + std::to_string(rows) + "x" + std::to_string(cols));
  const int chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  BULKHEAD_ASSIGN_OR_RETURN(DeviceMemory partial,
                            DeviceMemory::allocate(size_t(chunks) * cols * 2 * sizeof(double)));
  double* sums = partial.get<double>();
  double* abs_sums = sums + size_t(chunks) * cols;
  const unsigned col_blocks = unsigned((cols + kThreads - 1) / kThreads);
  partialSumsKernel<<<dim3(col_blocks, unsigned(chunks)), kThreads, 0, stream>>>(w, rows, cols,
                                                                                 sums, abs_sums);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  totalSumsKernel<<<col_blocks, kThreads, 0, stream>>>(sums, abs_sums, chunks, cols, scale, colsum,
                                                       abssum);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // The partials are freed on return: wait until the kernels are done with them.
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return okStatus();
}

}  // namespace bulkhead::cuda
