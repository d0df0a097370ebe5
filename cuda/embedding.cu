// Embedding: one block per row, a strided copy with the bf16 -> fp32 widening (exact).
#include "cuda/embedding.cuh"

#include <string>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    embeddingKernel(const __nv_bfloat16* __restrict__ table, int hidden,
                    const uint32_t* __restrict__ tokens, float* __restrict__ out) {
  const __nv_bfloat16* src = table + size_t(tokens[blockIdx.x]) * hidden;
  float* dst = out + size_t(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += kThreads) dst[i] = __bfloat162float(src[i]);
}

}  // namespace

Status launchEmbedding(const __nv_bfloat16* table, int hidden, const uint32_t* tokens, int rows,
                       float* out, cudaStream_t stream) {
  if (rows < 0 || hidden <= 0)
    return invalidArgument("embedding of " + std::to_string(rows) + " rows of " +
                           std::to_string(hidden));
  if (rows == 0) return okStatus();
  embeddingKernel<<<rows, kThreads, 0, stream>>>(table, hidden, tokens, out);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
