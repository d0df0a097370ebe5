// The end of a step's arithmetic checks, and the compute-fault injection.
#include "cuda/step_checks.cuh"

#include <algorithm>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

__global__ void countFailedKernel(ProductCheck* products, int total, int roles,
                                  const ProductScale* scales, ProductCounts counts,
                                  const FoldAccount* folds, int fold_count,
                                  FoldTotal* fold_totals) {
  awaitKernelBefore();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < fold_count) fold_totals[i] = {folds[i].sum(), folds[i].words()};
  if (i >= total) return;
  const ProductCheck p = products[i];
  products[i] = ProductCheck{};                                          // zero for the next step
  if (p.bound == 0.0 && p.expected == 0.0 && p.produced == 0.0) return;  // not computed
  const int role = i % roles;
  atomicAdd(counts.checked + role, 1u);
  // The bound covers rounding; a tiny absolute term covers products of subnormal size.
  const double off = fabs(p.produced - p.expected);
  if (!(off <= p.bound + 1e-30)) {
    atomicAdd(counts.failed + role, 1u);
    return;
  }
  const ProductScale s = scales[role];
  const double usual = s.spread * (sqrt(p.produced_sq) + fabs(p.produced)) + s.colsum * p.bound;
  if (off > usual + 1e-30) atomicAdd(counts.strayed + role, 1u);
}

__global__ void flipKernel(float* y, size_t index) {
  gridDependencyWait();
  y[index] = __uint_as_float(__float_as_uint(y[index]) ^ 0x40000000u);
}

}  // namespace

Status launchCountFailedProducts(ProductCheck* products, int rows, int roles,
                                 const ProductScale* scales, ProductCounts counts,
                                 const FoldAccount* folds, int fold_count, FoldTotal* fold_totals,
                                 cudaStream_t stream) {
  const int total = rows * roles, threads = std::max(total, fold_count);
  if (threads <= 0) return okStatus();
  constexpr int kThreads = 256;
  BULKHEAD_CUDA_RETURN_IF_ERROR(
      launchKernel(countFailedKernel, dim3(unsigned((threads + kThreads - 1) / kThreads)), kThreads,
                   stream, products, total, roles, scales, counts, folds, fold_count, fold_totals));
  return okStatus();
}

Status launchFlipExponentBit(float* y, size_t index, cudaStream_t stream) {
  flipKernel<<<1, 1, 0, stream>>>(y, index);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
