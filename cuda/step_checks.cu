// The end of a step's arithmetic checks, and the compute-fault injection.
#include "cuda/step_checks.cuh"

#include <algorithm>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

__global__ void countFailedKernel(CheckCount c) {
  awaitKernelBefore();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < c.fold_count) totalFold(c, i);
  if (i < c.rows * c.roles) countProductCheck(c, i);
}

__global__ void flipKernel(float* y, size_t index) {
  gridDependencyWait();
  y[index] = __uint_as_float(__float_as_uint(y[index]) ^ 0x40000000u);
}

}  // namespace

Status launchCountFailedProducts(const CheckCount& c, cudaStream_t stream) {
  const int threads = std::max(c.rows * c.roles, c.fold_count);
  if (threads <= 0 || c.products == nullptr) return okStatus();
  constexpr int kThreads = 256;
  BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(
      countFailedKernel, dim3(unsigned((threads + kThreads - 1) / kThreads)), kThreads, stream, c));
  return okStatus();
}

Status launchFlipExponentBit(float* y, size_t index, cudaStream_t stream) {
  flipKernel<<<1, 1, 0, stream>>>(y, index);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
