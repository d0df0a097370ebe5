// uploadStaged: two pinned buffers, filled by a pool while the other one's copy runs.
#include "worker/staged_upload.h"

#include <algorithm>
#include <vector>

#include "cuda/resources.h"
#include "shared/work_pool.h"

namespace bulkhead {

Status uploadStaged(std::span<const Upload> uploads, cudaStream_t stream,
                    const StagingOptions& options) {
  const size_t stage_bytes = std::max<size_t>(options.stage_bytes, 1);
  cuda::PinnedMemory stage[2];
  cuda::Event copied[2];
  for (int b = 0; b < 2; ++b) {
    BULKHEAD_ASSIGN_OR_RETURN(stage[b], cuda::PinnedMemory::allocate(stage_bytes));
    BULKHEAD_ASSIGN_OR_RETURN(copied[b], cuda::Event::create());
  }
  WorkPool pool;
  bool in_flight[2] = {false, false};
  int b = 0;
  size_t filled = 0;
  std::vector<Upload> batch;  // what the current buffer holds, in order
  auto send = [&]() -> Status {
    if (batch.empty()) return okStatus();
    // The buffer's previous copy to the device must be done before the host overwrites it.
    if (in_flight[b]) BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied[b].get()));
    std::vector<ByteCopy> fills;
    std::byte* at = stage[b].get<std::byte>();
    for (const Upload& u : batch) {
      fills.push_back({u.from, at});
      at += u.from.size();
    }
    copyInPieces(pool, fills, options.piece_bytes);
    at = stage[b].get<std::byte>();
    for (const Upload& u : batch) {
      BULKHEAD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(u.to, at, u.from.size(), cudaMemcpyHostToDevice, stream));
      at += u.from.size();
    }
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied[b].get(), stream));
    in_flight[b] = true;
    b ^= 1;
    filled = 0;
    batch.clear();
    return okStatus();
  };
  auto sendAll = [&]() -> Status {
    for (const Upload& u : uploads) {
      for (size_t off = 0; off < u.from.size();) {
        const size_t n = std::min(stage_bytes - filled, u.from.size() - off);
        batch.push_back({u.from.subspan(off, n), u.to + off});
        filled += n;
        off += n;
        if (filled == stage_bytes) BULKHEAD_RETURN_IF_ERROR(send());
      }
    }
    return send();
  };
  const Status sent = sendAll();
  // Every copy sent finishes before the buffers are freed, after an error too.
  const cudaError_t synced = cudaStreamSynchronize(stream);
  BULKHEAD_RETURN_IF_ERROR(sent);
  BULKHEAD_CUDA_RETURN_IF_ERROR(synced);
  return okStatus();
}

}  // namespace bulkhead
