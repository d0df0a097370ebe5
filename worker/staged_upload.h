// Host-to-device copies of weights through pinned staging buffers (CUDA builds only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <span>

#include "shared/status.h"

namespace bulkhead {

// Host bytes to copy to a device address.
struct Upload {
  std::span<const std::byte> from;
  std::byte* to = nullptr;
};

struct StagingOptions {
  size_t stage_bytes = size_t(64) << 20;  // each of the two pinned buffers
  size_t piece_bytes = size_t(2) << 20;   // what one host thread copies at a time
};

// Copies `uploads` to the device through two pinned staging buffers: while one buffer's copy to
// the device runs on `stream`, the host's cores fill the other from the source (a checkpoint's
// mapping: pageable memory, which copies to the device at about a seventh of the pinned rate).
// Returns once every byte is on the device.
Status uploadStaged(std::span<const Upload> uploads, cudaStream_t stream,
                    const StagingOptions& options = {});

}  // namespace bulkhead
