// Logits out: grid (blocks per row, rows); each block copies a contiguous range of its row,
// four floats at a time when the destinations allow.
#include "cuda/logits.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPerBlock = 4096;  // floats of one row per block

__device__ void account(float v, uint32_t index, unsigned long long& sum, unsigned& bad,
                        double (&produced)[2]) {
  const uint32_t w = __float_as_uint(v);
  sum += checksumTerm(w, index);
  bad |= unsigned((w & 0x7f800000u) == 0x7f800000u);
  produced[0] += double(v);
  produced[1] += double(v) * double(v);
}

__global__ void __launch_bounds__(kThreads) logitsKernel(LogitsArgs a) {
  __shared__ double scratch[2 * kWarps];
  __shared__ unsigned long long sum_scratch[kWarps];
  awaitKernelBefore();
  const int r = blockIdx.y;
  const int begin = blockIdx.x * kPerBlock, end = min(a.vocab, begin + kPerBlock);
  const float* src = a.logits + size_t(r) * a.vocab;
  float* dst = a.dst[r];
  unsigned long long sum = 0;
  unsigned bad = 0;
  double produced[2] = {};  // lm_head's produced sum and sum of squares
  if ((a.aligned || a.rows_written) && a.vocab % 4 == 0) {
    for (int i = begin + 4 * threadIdx.x; i < end; i += 4 * kThreads) {
      const float4 v = *reinterpret_cast<const float4*>(src + i);
      if (!a.rows_written) *reinterpret_cast<float4*>(dst + i) = v;
      account(v.x, i, sum, bad, produced);
      account(v.y, i + 1, sum, bad, produced);
      account(v.z, i + 2, sum, bad, produced);
      account(v.w, i + 3, sum, bad, produced);
    }
  } else {
    for (int i = begin + threadIdx.x; i < end; i += kThreads) {
      const float v = src[i];
      if (!a.rows_written) dst[i] = v;
      account(v, i, sum, bad, produced);
    }
  }
  bad = __syncthreads_or(bad);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) sum_scratch[threadIdx.x / 32] = sum;
  blockSums(produced, scratch);  // its barriers publish sum_scratch
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < kWarps; ++w) total += sum_scratch[w];
    atomicAdd(a.row_sums + r, total);
    if (bad) atomicOr(a.row_nonfinite + r, 1u);
    if (a.role >= 0) {
      ProductCheck& p = a.checks.products[size_t(a.check_row + r) * a.checks.roles + a.role];
      atomicAdd(&p.produced, produced[0]);
      atomicAdd(&p.produced_sq, produced[1]);
    }
  }
}

}  // namespace

Status launchLogits(const LogitsArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.vocab <= 0)
    return invalidArgument("logits of " + std::to_string(a.rows) + " rows of " +
                           std::to_string(a.vocab));
  if (a.rows == 0) return okStatus();
  const unsigned blocks = unsigned((a.vocab + kPerBlock - 1) / kPerBlock);
  BULKHEAD_CUDA_RETURN_IF_ERROR(
      launchKernel(logitsKernel, dim3(blocks, unsigned(a.rows)), kThreads, stream, a));
  return okStatus();
}

}  // namespace bulkhead::cuda
