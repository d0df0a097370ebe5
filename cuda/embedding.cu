// Embedding: one block per row, a strided copy of bf16 pairs with the exact widening to fp32.
#include "cuda/embedding.cuh"

#include <string>

#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"
#include "cuda/norm_partials.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    embeddingKernel(const __nv_bfloat16* __restrict__ table, int hidden,
                    const uint32_t* __restrict__ tokens, float* __restrict__ out, FoldAccount* fold,
                    uint32_t salt, float* __restrict__ partials, int partials_stride) {
  awaitKernelBefore();
  const int pairs = hidden / 2;
  const uint64_t first_word = uint64_t(tokens[blockIdx.x]) * pairs;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(table) + first_word;
  float2* dst = reinterpret_cast<float2*>(out + size_t(blockIdx.x) * hidden);
  unsigned long long sum = 0;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const uint32_t word = src[i];
    if (fold != nullptr) sum += foldTerm(word, salt, uint32_t(first_word + i));
    __nv_bfloat162 v;
    memcpy(&v, &word, 4);
    dst[i] = __bfloat1622float2(v);
  }
  if (fold != nullptr) addFold(fold, sum, (unsigned long long)pairs);
  if (partials == nullptr) return;
  // The norm tiles' partials of the row, from the same (exactly widened) values.
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(src);
  for (int tile = threadIdx.x; tile < normTiles(hidden); tile += kThreads) {
    float squares[kNormTile];
#pragma unroll
    for (int j = 0; j < kNormTile; ++j) {
      const int i = tile * kNormTile + j;
      const float v = i < hidden ? __uint_as_float(uint32_t(halves[i]) << 16) : 0.0f;
      squares[j] = __fmul_rn(v, v);
    }
    partials[size_t(blockIdx.x) * partials_stride + tile] = normTilePartial(squares);
  }
}

}  // namespace

Status launchEmbedding(const __nv_bfloat16* table, int hidden, const uint32_t* tokens, int rows,
                       float* out, cudaStream_t stream, FoldAccount* fold, uint32_t salt,
                       float* partials, int partials_stride) {
  if (rows < 0 || hidden <= 0 || hidden % 2 != 0 ||
      (partials != nullptr && partials_stride < normTiles(hidden)))
    return invalidArgument("embedding of " + std::to_string(rows) + " rows of " +
                           std::to_string(hidden));
  if (rows == 0) return okStatus();
  BULKHEAD_CUDA_RETURN_IF_ERROR(launchKernel(embeddingKernel, dim3(unsigned(rows)), kThreads,
                                             stream, table, hidden, tokens, out, fold, salt,
                                             partials, partials_stride));
  return okStatus();
}

}  // namespace bulkhead::cuda
