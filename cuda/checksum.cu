// Granule checksum kernel: each thread mixes a strided set of 32-bit words, a warp sums them with
// shuffles, and one atomic add per warp folds them in. Integer addition wraps and commutes, so the
// result equals the host loop's exactly, whatever the launch shape.
#include "cuda/checksum.cuh"

#include "cuda/cuda_check.cuh"
#include "shared/mix.h"

namespace bulkhead::cuda {
namespace {

// grid: (blocks per granule, granules)
__global__ void granuleChecksumKernel(const unsigned char* data, size_t bytes, size_t granule_bytes,
                                      unsigned long long* out) {
  const size_t granule = blockIdx.y;
  const size_t begin = granule * granule_bytes;
  const size_t len = min(granule_bytes, bytes - begin);
  const size_t words = len / 4;
  const unsigned char* base = data + begin;
  uint64_t sum = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(base + i * 4);
    sum += checksumTerm(w, uint32_t(i));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && len % 4 != 0) {
    uint32_t w = 0;
    for (size_t k = 0; k < len % 4; ++k) w |= uint32_t(base[words * 4 + k]) << (8 * k);
    sum += checksumTerm(w, uint32_t(words));
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out + granule, static_cast<unsigned long long>(sum));
}

// grid: (blocks per range, ranges of this launch); out zeroed before.
__global__ void rangeChecksumKernel(const DeviceRange* ranges, unsigned long long* out) {
  const DeviceRange range = ranges[blockIdx.y];
  const unsigned char* base = static_cast<const unsigned char*>(range.data);
  const size_t words = range.bytes / 4;
  uint64_t sum = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const bool aligned = uintptr_t(base) % 4 == 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    uint32_t w;
    if (aligned) {
      w = *reinterpret_cast<const uint32_t*>(base + i * 4);
    } else {
      const unsigned char* b = base + i * 4;
      w = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
    }
    sum += checksumTerm(w, uint32_t(i));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && range.bytes % 4 != 0) {
    uint32_t w = 0;
    for (size_t k = 0; k < range.bytes % 4; ++k) w |= uint32_t(base[words * 4 + k]) << (8 * k);
    sum += checksumTerm(w, uint32_t(words));
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.y, static_cast<unsigned long long>(sum));
}

}  // namespace

Status launchRangeChecksums(const DeviceRange* ranges, int count, uint64_t* out,
                            cudaStream_t stream) {
  if (count <= 0) return okStatus();
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, size_t(count) * sizeof(uint64_t), stream));
  constexpr int kThreads = 256, kBlocksPerRange = 8, kMaxGridY = 65535;
  for (int first = 0; first < count; first += kMaxGridY) {
    const int n = std::min(kMaxGridY, count - first);
    rangeChecksumKernel<<<dim3(kBlocksPerRange, unsigned(n)), kThreads, 0, stream>>>(
        ranges + first, reinterpret_cast<unsigned long long*>(out + first));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return okStatus();
}

Status launchGranuleChecksums(const void* data, size_t bytes, size_t granule_bytes, uint64_t* out,
                              cudaStream_t stream) {
  if (granule_bytes == 0 || granule_bytes % 4 != 0)
    return invalidArgument("granule size must be a positive multiple of 4");
  if (uintptr_t(data) % 4 != 0) return invalidArgument("checksum data must be 4-byte aligned");
  const size_t granules = (bytes + granule_bytes - 1) / granule_bytes;
  if (granules == 0) return okStatus();
  if (granules > 65535) return invalidArgument("too many granules for one launch");
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, granules * sizeof(uint64_t), stream));
  constexpr int kThreads = 256;
  const int blocks_per_granule =
      int(std::min<size_t>(64, (granule_bytes / 4 + kThreads - 1) / kThreads));
  granuleChecksumKernel<<<dim3(blocks_per_granule, unsigned(granules)), kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(data), bytes, granule_bytes,
      reinterpret_cast<unsigned long long*>(out));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
