// SiLU * up: one block per row, threads striding over the row's elements.
#include "cuda/activation.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) siluMulKernel(SiluMulArgs a) {
  __shared__ double scratch[kWarps];
  const int r = blockIdx.x;
  const float* gate = a.gate_up + size_t(r) * 2 * a.inter;
  const float* up = gate + a.inter;
  __nv_bfloat16* out = a.out + size_t(r) * a.inter;
  double gate_sum = 0.0, up_sum = 0.0, expected = 0.0, bound = 0.0;
  for (int i = threadIdx.x; i < a.inter; i += kThreads) {
    const float g = gate[i], u = up[i];
    gate_sum += double(g);
    up_sum += double(u);
    const __nv_bfloat16 o =
        __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
    out[i] = o;
    if (a.down.role >= 0) {
      const float of = __bfloat162float(o);
      expected += double(a.down.colsum[i]) * of;
      bound += double(a.down.abssum[i]) * fabsf(of);
    }
  }
  ProductCheck* row = a.checks.products + size_t(r) * a.checks.roles;
  if (a.gate_role >= 0) {
    gate_sum = blockSum(gate_sum, scratch);
    if (threadIdx.x == 0) atomicAdd(&row[a.gate_role].produced, gate_sum);
  }
  if (a.up_role >= 0) {
    up_sum = blockSum(up_sum, scratch);
    if (threadIdx.x == 0) atomicAdd(&row[a.up_role].produced, up_sum);
  }
  if (a.down.role >= 0) {
    expected = blockSum(expected, scratch);
    bound = blockSum(bound, scratch);
    if (threadIdx.x == 0) {
      atomicAdd(&row[a.down.role].expected, expected);
      atomicAdd(&row[a.down.role].bound, bound);
    }
  }
}

}  // namespace

Status launchSiluMul(const SiluMulArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.inter <= 0)
    return invalidArgument("silu of " + std::to_string(a.rows) + " rows of " +
                           std::to_string(a.inter));
  if (a.rows == 0) return okStatus();
  siluMulKernel<<<a.rows, kThreads, 0, stream>>>(a);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

Status launchSiluMul(const float* gate_up, int rows, int inter, __nv_bfloat16* out,
                     cudaStream_t stream) {
  SiluMulArgs a;
  a.gate_up = gate_up;
  a.rows = rows;
  a.inter = inter;
  a.out = out;
  return launchSiluMul(a, stream);
}

}  // namespace bulkhead::cuda
