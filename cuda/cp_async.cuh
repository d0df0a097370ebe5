// cp.async (sm_80 and later): copies of 16 bytes from global into shared memory that stay in
// flight while the thread goes on, committed in groups and waited for by group.
#pragma once

#include <cuda_runtime.h>

namespace bulkhead::cuda {

// 16 bytes from `global` to `shared`, in flight until waited for; zeros when !valid (then
// nothing is read, but `global` must still be a valid address).
__device__ __forceinline__ void cpAsync16(void* shared, const void* global, bool valid) {
  const unsigned to = unsigned(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
               "r"(valid ? 16 : 0));  // 0 bytes read: the 16 written are zeros
}

// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace bulkhead::cuda
