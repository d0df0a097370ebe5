// Granule checksums of device memory, the same function as shared/checksum.h computes on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shared/status.h"

namespace bulkhead::cuda {

// Writes ceil(bytes / granule_bytes) checksums of `data` (device memory) into `out` (device
// memory), asynchronously on `stream`. granule_bytes must be a multiple of 4.
Status launchGranuleChecksums(const void* data, size_t bytes, size_t granule_bytes, uint64_t* out,
                              cudaStream_t stream);

// One byte range of device memory (any alignment).
struct DeviceRange {
  const void* data;
  size_t bytes;
};

// out[i] = checksumBytes() of ranges[i], for `count` ranges in one launch (ranges and out in
// device memory), asynchronously on `stream`.
Status launchRangeChecksums(const DeviceRange* ranges, int count, uint64_t* out,
                            cudaStream_t stream);

}  // namespace bulkhead::cuda
