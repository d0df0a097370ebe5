// Which streams launch a step's kernels programmatically.
#include "cuda/launch.cuh"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

namespace bulkhead::cuda {
namespace {

std::mutex streams_mu;
// How many streams launch programmatically: while none does (the default), a launch looks no
// further and takes no lock.
std::atomic<size_t> programmatic_streams{0};

__global__ void probeKernel() {}
std::vector<cudaStream_t>& programmaticStreams() {
  static std::vector<cudaStream_t> streams;
  return streams;
}

}  // namespace

bool programmaticLaunchSupported() {
  int device = 0, major = 0;
  cudaFuncAttributes attributes{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attributes, probeKernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 9 && attributes.binaryVersion >= 90;
}

int carveoutPercent(size_t block_bytes) {
  int device = 0, per_sm = 0, reserved = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) !=
          cudaSuccess ||
      per_sm <= 0) {
    (void)cudaGetLastError();
    return -1;  // no preference
  }
  const size_t need = block_bytes + size_t(reserved);
  return int(std::min<size_t>(100, (100 * need + size_t(per_sm) - 1) / size_t(per_sm)));
}

void setProgrammaticLaunch(cudaStream_t stream, bool on) {
  std::lock_guard lock(streams_mu);
  auto& streams = programmaticStreams();
  const auto at = std::find(streams.begin(), streams.end(), stream);
  if (on && at == streams.end()) streams.push_back(stream);
  if (!on && at != streams.end()) streams.erase(at);
  programmatic_streams.store(streams.size());
}

bool programmaticLaunch(cudaStream_t stream) {
  if (programmatic_streams.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard lock(streams_mu);
  const auto& streams = programmaticStreams();
  return std::find(streams.begin(), streams.end(), stream) != streams.end();
}

unsigned addProgrammaticAttribute(cudaStream_t stream, cudaLaunchAttribute* attrs, unsigned count) {
  if (!programmaticLaunch(stream)) return count;
  attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[count].val.programmaticStreamSerializationAllowed = 1;
  return count + 1;
}

}  // namespace bulkhead::cuda
