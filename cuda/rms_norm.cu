// RMSNorm: one block of kThreads per row, the row held in registers (loaded once, all loads
// issued before the arithmetic, the weight's and the column sums' too). Each thread sums a fixed
// strided slice of pairs in order, then a fixed butterfly within warps and a fixed sum over the
// warps.
#include "cuda/rms_norm.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"
#include "cuda/norm_partials.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPairs = 8;  // per thread: rows of up to 8192 values, held in registers
static_assert(2 * kMaxPairs * kThreads == kMaxNormHidden);

// The normalised row into out row out_r (skipped when negative), with the norm weight's fold and
// the consumers' side of their checks; `produced` (the delta product's sum and sum of squares,
// row r) is added with them. v: the residual row's pairs, this thread's slice.
template <int kPairs>
__device__ __forceinline__ void normalise(const RmsNormArgs& a, const float2 (&v)[kPairs],
                                          const uint32_t (&words)[kPairs],
                                          const float2 (&cs)[kMaxNormConsumers][kPairs],
                                          const float2 (&as)[kMaxNormConsumers][kPairs], int r,
                                          int out_r, float inv, const double (&produced)[2]) {
  static_assert(kMaxNormConsumers == 3, "the checks' eight sums below");
  const int pairs = a.hidden / 2;
  // The delta product's sum and sum of squares, then per consumer its expected sum, then bound.
  double sums[8] = {produced[0], produced[1]};
  if (out_r >= 0) {  // uniform across the block
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(a.out + size_t(out_r) * a.hidden);
    unsigned long long fold = 0;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = threadIdx.x + j * kThreads;
      if (i >= pairs) break;
      if (a.weight_fold >= 0) fold += foldTerm(words[j], a.weight_salt, uint32_t(i));
      __nv_bfloat162 w;
      memcpy(&w, &words[j], 4);
      const __nv_bfloat162 o = __floats2bfloat162_rn(__bfloat162float(w.x) * (v[j].x * inv),
                                                     __bfloat162float(w.y) * (v[j].y * inv));
      dst[i] = o;
      const float o0 = __bfloat162float(o.x), o1 = __bfloat162float(o.y);
#pragma unroll
      for (int c = 0; c < kMaxNormConsumers; ++c) {
        if (a.consumers[c].role < 0) continue;
        sums[2 + c] += double(cs[c][j].x) * o0 + double(cs[c][j].y) * o1;
        sums[5 + c] += double(as[c][j].x) * fabsf(o0) + double(as[c][j].y) * fabsf(o1);
      }
    }
    if (a.weight_fold >= 0)
      addFold(a.checks.folds + a.weight_fold, fold, (unsigned long long)pairs);
  }
  // Consumers fill from the first.
  if (a.delta_role < 0 && (out_r < 0 || a.consumers[0].role < 0)) return;
  const double total = warpTotalSpread(sums);
  const int i = spreadIndex<8>();
  if (i < 0) return;
  double* dst = nullptr;
  if (i < 2) {
    if (a.delta_role >= 0) {
      ProductCheck& p = a.checks.products[size_t(r) * a.checks.roles + a.delta_role];
      dst = i == 0 ? &p.produced : &p.produced_sq;
    }
  } else {
    const int c = (i - 2) % 3,  // selects, not an index into the parameters
        role = c == 0   ? a.consumers[0].role
               : c == 1 ? a.consumers[1].role
                        : a.consumers[2].role;
    if (out_r >= 0 && role >= 0) {
      ProductCheck& p = a.checks.products[size_t(out_r) * a.checks.roles + role];
      dst = i < 5 ? &p.expected : &p.bound;
    }
  }
  if (dst != nullptr) atomicAdd(dst, total);
}

// kPairs pairs a thread, the fewest that cover the row: the same slices and order as any larger
// count, so the result does not depend on it.
template <int kPairs>
__global__ void __launch_bounds__(kThreads) rmsNormKernel(RmsNormArgs a) {
  __shared__ float warp_sums[kWarps];
  const int r = blockIdx.x, pairs = a.hidden / 2;
  const int out_r = a.out_row != nullptr ? a.out_row[r] : r;
  float2* row = reinterpret_cast<float2*>(a.x + size_t(r) * a.hidden);
  const float2* delta =
      a.delta ? reinterpret_cast<const float2*>(a.delta + size_t(r) * a.hidden) : nullptr;
  const uint32_t* weight_words = reinterpret_cast<const uint32_t*>(a.weight);
  // Every load first, the weight and the consumers' column sums included, then the arithmetic:
  // one memory latency a launch rather than one a phase. The weight and the column sums (which
  // no kernel writes) before the wait for the kernel before, the row after it.
  float2 v[kPairs], d[kPairs], cs[kMaxNormConsumers][kPairs], as[kMaxNormConsumers][kPairs];
  uint32_t words[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    const bool in = i < pairs;
    words[j] = in && out_r >= 0 ? weight_words[i] : 0u;
#pragma unroll
    for (int c = 0; c < kMaxNormConsumers; ++c) {
      const bool used = in && out_r >= 0 && a.consumers[c].role >= 0;
      cs[c][j] = used ? reinterpret_cast<const float2*>(a.consumers[c].colsum)[i]
                      : make_float2(0.0f, 0.0f);
      as[c][j] = used ? reinterpret_cast<const float2*>(a.consumers[c].abssum)[i]
                      : make_float2(0.0f, 0.0f);
    }
  }
  awaitKernelBefore();
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    const bool in = i < pairs;
    v[j] = in ? row[i] : make_float2(0.0f, 0.0f);
    d[j] = in && delta != nullptr ? delta[i] : make_float2(0.0f, 0.0f);
  }
  if (a.partials != nullptr) {
    // Every warp adds the row's partials up itself (the same bits): no barrier.
    const float total =
        rowSumOfSquares(a.partials + size_t(r) * a.partials_stride, normTiles(a.hidden));
    normalise(a, v, words, cs, as, r, out_r, 1.0f / sqrtf(total / float(a.hidden) + a.eps),
              {0.0, 0.0});
    return;
  }
  float sum = 0.0f;
  double produced[2] = {};  // the delta product's sum and sum of squares
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= pairs) break;
    if (delta != nullptr) {
      produced[0] += double(d[j].x) + double(d[j].y);
      produced[1] += double(d[j].x) * double(d[j].x) + double(d[j].y) * double(d[j].y);
      v[j].x = __fadd_rn(v[j].x, d[j].x);
      v[j].y = __fadd_rn(v[j].y, d[j].y);
      row[i] = v[j];
    }
    sum = fmaf(v[j].x, v[j].x, sum);
    sum = fmaf(v[j].y, v[j].y, sum);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / float(a.hidden) + a.eps);
  normalise(a, v, words, cs, as, r, out_r, inv, produced);
}

}  // namespace

Status launchRmsNorm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.rows < 0 || args.hidden <= 0 || args.hidden % 2 != 0 || args.hidden > kMaxNormHidden)
    return invalidArgument("rms norm of " + std::to_string(args.rows) + " rows of " +
                           std::to_string(args.hidden));
  if (args.partials != nullptr && (args.delta != nullptr || args.delta_role >= 0 ||
                                   args.partials_stride < normTiles(args.hidden)))
    return invalidArgument("rms norm from partials " + std::to_string(args.partials_stride) +
                           " apart, with a delta to add: the residual is already summed");
  if (args.rows == 0) return okStatus();
  const int per_thread = (args.hidden / 2 + kThreads - 1) / kThreads;
  const dim3 grid(unsigned(args.rows));
  if (per_thread <= 1)
    BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(rmsNormKernel<1>, grid, kThreads, stream, args));
  else if (per_thread <= 2)
    BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(rmsNormKernel<2>, grid, kThreads, stream, args));
  else if (per_thread <= 4)
    BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(rmsNormKernel<4>, grid, kThreads, stream, args));
  else
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        launchKernel(rmsNormKernel<kMaxPairs>, grid, kThreads, stream, args));
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
