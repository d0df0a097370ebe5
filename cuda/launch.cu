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
