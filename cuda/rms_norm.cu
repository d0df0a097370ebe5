// RMSNorm: one block of kThreads per row; each thread sums a fixed strided slice in order, then
// a fixed butterfly within warps and a fixed sum over the warps.
#include "cuda/rms_norm.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    rmsNormKernel(const float* __restrict__ x, int hidden, const __nv_bfloat16* __restrict__ weight,
                  float eps, __nv_bfloat16* __restrict__ out) {
  const float* row = x + size_t(blockIdx.x) * hidden;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += kThreads) sum = fmaf(row[i], row[i], sum);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kWarps];
  __shared__ float inv;
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
    inv = 1.0f / sqrtf(total / float(hidden) + eps);
  }
  __syncthreads();
  __nv_bfloat16* dst = out + size_t(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += kThreads)
    dst[i] = __float2bfloat16_rn(__bfloat162float(weight[i]) * (row[i] * inv));
}

}  // namespace

Status launchRmsNorm(const float* x, int rows, int hidden, const __nv_bfloat16* weight, float eps,
                     __nv_bfloat16* out, cudaStream_t stream) {
  if (rows < 0 || hidden <= 0)
    return invalidArgument("rms norm of " + std::to_string(rows) + " rows of " +
                           std::to_string(hidden));
  if (rows == 0) return okStatus();
  rmsNormKernel<<<rows, kThreads, 0, stream>>>(x, hidden, weight, eps, out);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
