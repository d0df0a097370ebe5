// SiLU * up: one thread per output element.
#include "cuda/activation.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    siluMulKernel(const float* __restrict__ gate_up, int64_t total, int inter,
                  __nv_bfloat16* __restrict__ out) {
  const int64_t index = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= total) return;
  const int64_t r = index / inter, i = index % inter;
  const float g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
  out[index] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
}

}  // namespace

Status launchSiluMul(const float* gate_up, int rows, int inter, __nv_bfloat16* out,
                     cudaStream_t stream) {
  if (rows < 0 || inter <= 0)
    return invalidArgument("silu of " + std::to_string(rows) + " rows of " + std::to_string(inter));
  if (rows == 0) return okStatus();
  const int64_t total = int64_t(rows) * inter;
  siluMulKernel<<<unsigned((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      gate_up, total, inter, out);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
