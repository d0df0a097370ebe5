// CUDA status checking for the worker: every runtime call's status is checked; failures carry
// the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "shared/status.h"

namespace bulkhead::cuda {

inline Status cudaStatus(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return okStatus();
  // A failed call is also the runtime's "last error": clear it, so the next launch's check does
  // not report it again as its own.
  (void)cudaGetLastError();
  return internalError(std::string(what) + " failed at " + file + ":" + std::to_string(line) +
                       ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace bulkhead::cuda

#define BULKHEAD_CUDA_RETURN_IF_ERROR(call) \
  BULKHEAD_RETURN_IF_ERROR(::bulkhead::cuda::cudaStatus((call), #call, __FILE__, __LINE__))
