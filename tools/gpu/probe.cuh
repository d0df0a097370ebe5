// What the standalone GPU probes in tools/gpu share (each builds alone with nvcc, outside the
// project's build): a checked CUDA call, a bf16 pair loaded as one word, and mma.sync's bf16
// m16n8k16 product with fp32 accumulation, the warp product the CUDA backend's kernels use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

// Two consecutive bf16 values as one 32-bit word (the first in the low half).
__device__ __forceinline__ uint32_t pairOf(const __nv_bfloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// d += A (16 x 16, fragments a0..a3) times B (16 x 8, fragments b0, b1).
__device__ __forceinline__ void mmaBf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
