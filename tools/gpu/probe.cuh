// What the standalone GPU probes in tools/gpu share (each builds alone with nvcc, outside the
// project's build): a checked CUDA call, and the backend's own warp product and bf16 pairs
// (cuda/warp_mma.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../cuda/warp_mma.cuh"

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

using bulkhead::cuda::loadTransposed;
using bulkhead::cuda::mmaBf16;
using bulkhead::cuda::packRounded;
using bulkhead::cuda::pairOf;
