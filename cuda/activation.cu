// SiLU * up: blocks of 256 elements of a row (small blocks: a row's checks, in double, spread over
// many multiprocessors), every load issued before the arithmetic.
#include "cuda/activation.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kPerThread = 2;
constexpr int kPerBlock = kThreads * kPerThread;

// grid: (blocks per row, rows). Each element is computed alone; the checks' sums add up over a
// row's blocks (in double, so the order they arrive in does not matter to the check).
__global__ void __launch_bounds__(kThreads) siluMulKernel(SiluMulArgs a) {
  const int r = blockIdx.y, first = blockIdx.x * kPerBlock;
  const float* gate = a.gate_up + size_t(r) * 2 * a.inter;
  const float* up = gate + a.inter;
  __nv_bfloat16* out = a.out + size_t(r) * a.inter;
  float g[kPerThread], u[kPerThread], cs[kPerThread], as[kPerThread];
  // The column sums (which no kernel writes) before the wait for the product before, its
  // output after.
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = first + threadIdx.x + j * kThreads;
    const bool check = i < a.inter && a.down.role >= 0;
    cs[j] = check ? a.down.colsum[i] : 0.0f;
    as[j] = check ? a.down.abssum[i] : 0.0f;
  }
  awaitKernelBefore();
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = first + threadIdx.x + j * kThreads;
    const bool in = i < a.inter;
    g[j] = in ? gate[i] : 0.0f;
    u[j] = in ? up[i] : 0.0f;
  }
  // gate and up (sums, then sums of squares), the down product's expected and bound; two spare
  double sums[8] = {};
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = first + threadIdx.x + j * kThreads;
    if (i >= a.inter) break;
    const __nv_bfloat16 o = siluMul(g[j], u[j]);
    out[i] = o;
    const float of = __bfloat162float(o);
    sums[0] += double(g[j]);
    sums[1] += double(u[j]);
    sums[2] += double(g[j]) * double(g[j]);
    sums[3] += double(u[j]) * double(u[j]);
    sums[4] += double(cs[j]) * of;
    sums[5] += double(as[j]) * fabsf(of);
  }
  if (a.gate_role < 0 && a.up_role < 0 && a.down.role < 0) return;
  const double total = warpTotalSpread(sums);
  const int i = spreadIndex<8>();
  if (i < 0 || i > 5) return;
  ProductCheck* row = a.checks.products + size_t(r) * a.checks.roles;
  const int role = i == 0 || i == 2 ? a.gate_role : i == 1 || i == 3 ? a.up_role : a.down.role;
  if (role < 0) return;
  ProductCheck& p = row[role];
  atomicAdd(i < 2 ? &p.produced : i < 4 ? &p.produced_sq : i == 4 ? &p.expected : &p.bound, total);
}

}  // namespace

Status launchSiluMul(const SiluMulArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.inter <= 0)
    return invalidArgument("silu of " + std::to_string(a.rows) + " rows of " +
                           std::to_string(a.inter));
  if (a.rows == 0) return okStatus();
  const dim3 grid(unsigned((a.inter + kPerBlock - 1) / kPerBlock), unsigned(a.rows));
  BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(siluMulKernel, grid, kThreads, stream, a));
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
