// Kernel launches for a step, optionally programmatic (programmatic dependent launch, sm_90): a
// kernel launched so may begin while the kernel before it on the stream is finishing, and its
// launch and the loads that depend on nothing earlier overlap that kernel's tail.
//
// The contract every kernel of a step keeps, so that enabling it changes no result: before
// gridDependencyWait() a thread reads only what no kernel writes during steps (weights, their
// column sums, rope tables, the step's inputs copied in before its first kernel) and writes
// nothing; every thread calls it before anything else and before it returns, so a kernel's
// completion still implies the completion of every kernel before it. Kernels wait through
// awaitKernelBefore(), which also lets the next kernel launch.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace bulkhead::cuda {

// Returns once the kernel before this one on the stream has completed and its writes are
// visible (at once when this kernel was not launched programmatically).
__device__ __forceinline__ void gridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream launch once every block of this one has called it.
__device__ __forceinline__ void allowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Where a kernel starts on what the kernel before it wrote: the next kernel is let launch, then
// the wait above. So the next kernel's own loads before its wait (weights) overlap this kernel's
// wait and the kernel before it as well, and its wait still orders it after this kernel, whose
// completion implies the completion of every kernel before it. A kernel launches only once every
// block of the one before has started, so every launched kernel but the last is wholly resident
// and none waits for room that a later one holds. (Letting it launch after the wait instead: H100,
// bench-engine ms a step at 1 / 8 rows, 0.5B 0.954-0.970 / 1.101-1.138 against 0.943-0.947 /
// 1.015-1.030 this way; 7B 6.055-6.090 / 6.607-6.628 against 6.004-6.008 / 6.540-6.586.)
__device__ __forceinline__ void awaitKernelBefore() {
  allowDependentLaunch();
  gridDependencyWait();
}

// Whether the current device and this build's kernels can launch programmatically: a device of
// compute capability 9.0 or later running code built for it (built for an older architecture,
// gridDependencyWait() would compile to nothing and the kernels would race).
bool programmaticLaunchSupported();

// The shared-memory carveout (cudaFuncAttributePreferredSharedMemoryCarveout, percent of the
// current device's shared memory a multiprocessor) that holds one block of `block_bytes`: the
// driver takes the smallest configuration at least this large, leaving the rest to the L1 cache.
int carveoutPercent(size_t block_bytes);

// Whether a step's kernels on `stream` launch programmatically (off for any stream until set).
void setProgrammaticLaunch(cudaStream_t stream, bool on);
bool programmaticLaunch(cudaStream_t stream);

// The launch attribute for `stream`, if its launches are programmatic: appends it to `attrs`
// and returns the new count.
unsigned addProgrammaticAttribute(cudaStream_t stream, cudaLaunchAttribute* attrs, unsigned count);

// kernel<<<grid, block, shared_bytes, stream>>>(args...), programmatic if the stream's launches
// are.
template <typename... Params, typename... Args>
cudaError_t launchKernelShared(void (*kernel)(Params...), dim3 grid, dim3 block,
                               size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attrs[1];
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = addProgrammaticAttribute(stream, attrs, 0);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, 0, stream>>>(args...), programmatic if the stream's launches are.
template <typename... Params, typename... Args>
cudaError_t launchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                         Args&&... args) {
  return launchKernelShared(kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace bulkhead::cuda
