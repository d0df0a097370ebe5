// RMSNorm: one block of kThreads per row. Each thread sums a fixed strided slice of pairs in
// order, then a fixed butterfly within warps and a fixed sum over the warps.
#include "cuda/rms_norm.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) rmsNormKernel(RmsNormArgs a) {
  __shared__ float warp_sums[kWarps];
  __shared__ double scratch[kWarps];
  __shared__ unsigned long long fold_scratch[kWarps];
  const int r = blockIdx.x, pairs = a.hidden / 2;
  float2* row = reinterpret_cast<float2*>(a.x + size_t(r) * a.hidden);
  const float2* delta =
      a.delta ? reinterpret_cast<const float2*>(a.delta + size_t(r) * a.hidden) : nullptr;
  float sum = 0.0f;
  double produced = 0.0;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    float2 v = row[i];
    if (delta != nullptr) {
      const float2 d = delta[i];
      produced += double(d.x) + double(d.y);
      v.x = __fadd_rn(v.x, d.x);
      v.y = __fadd_rn(v.y, d.y);
      row[i] = v;
    }
    sum = fmaf(v.x, v.x, sum);
    sum = fmaf(v.y, v.y, sum);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / float(a.hidden) + a.eps);
  if (a.delta_role >= 0) {
    produced = blockSum(produced, scratch);
    if (threadIdx.x == 0)
      atomicAdd(&a.checks.products[size_t(r) * a.checks.roles + a.delta_role].produced, produced);
  }

  const int out_r = a.out_row != nullptr ? a.out_row[r] : r;
  if (out_r < 0) return;  // uniform across the block
  const uint32_t* weight_words = reinterpret_cast<const uint32_t*>(a.weight);
  __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(a.out + size_t(out_r) * a.hidden);
  double expected[kMaxNormConsumers] = {}, bound[kMaxNormConsumers] = {};
  unsigned long long fold = 0;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const uint32_t word = weight_words[i];
    if (a.weight_fold >= 0) fold += foldTerm(word, a.weight_salt, uint64_t(i));
    __nv_bfloat162 w;
    memcpy(&w, &word, 4);
    const float2 v = row[i];
    const __nv_bfloat162 o = __floats2bfloat162_rn(__bfloat162float(w.x) * (v.x * inv),
                                                   __bfloat162float(w.y) * (v.y * inv));
    dst[i] = o;
    const float o0 = __bfloat162float(o.x), o1 = __bfloat162float(o.y);
#pragma unroll
    for (int c = 0; c < kMaxNormConsumers; ++c) {
      if (a.consumers[c].role < 0) continue;
      const float* cs = a.consumers[c].colsum + 2 * i;
      const float* as = a.consumers[c].abssum + 2 * i;
      expected[c] += double(cs[0]) * o0 + double(cs[1]) * o1;
      bound[c] += double(as[0]) * fabsf(o0) + double(as[1]) * fabsf(o1);
    }
  }
  if (a.weight_fold >= 0)
    addFold(a.checks.folds + a.weight_fold, fold, (unsigned long long)pairs, fold_scratch);
#pragma unroll
  for (int c = 0; c < kMaxNormConsumers; ++c) {
    if (a.consumers[c].role < 0) continue;
    const double e = blockSum(expected[c], scratch), b = blockSum(bound[c], scratch);
    if (threadIdx.x == 0) {
      ProductCheck& p = a.checks.products[size_t(out_r) * a.checks.roles + a.consumers[c].role];
      atomicAdd(&p.expected, e);
      atomicAdd(&p.bound, b);
    }
  }
}

}  // namespace

Status launchRmsNorm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.rows < 0 || args.hidden <= 0 || args.hidden % 2 != 0)
    return invalidArgument("rms norm of " + std::to_string(args.rows) + " rows of " +
                           std::to_string(args.hidden));
  if (args.rows == 0) return okStatus();
  rmsNormKernel<<<args.rows, kThreads, 0, stream>>>(args);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

Status launchRmsNorm(const float* x, int rows, int hidden, const __nv_bfloat16* weight, float eps,
                     __nv_bfloat16* out, cudaStream_t stream) {
  RmsNormArgs args;
  args.x = const_cast<float*>(x);  // read only: no delta
  args.rows = rows;
  args.hidden = hidden;
  args.weight = weight;
  args.eps = eps;
  args.out = out;
  return launchRmsNorm(args, stream);
}

}  // namespace bulkhead::cuda
