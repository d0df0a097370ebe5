// The warp-level tensor-core arithmetic the kernels share (and the GPU probes in tools/gpu, which
// include this file): mma.sync's bf16 m16n8k16 product with fp32 accumulation, the one product
// every matrix multiply and the tensor-core attention use, bf16 pairs as the 32-bit words its
// fragments are made of, and the transposed fragment load from shared memory.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace bulkhead::cuda {

// d += A (16 x 16, fragments a0..a3) times B (16 x 8, fragments b0, b1).
__device__ __forceinline__ void mmaBf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two consecutive bf16 values as one 32-bit word (the first in the low half).
__device__ __forceinline__ uint32_t pairOf(const __nv_bfloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Two floats rounded to bf16 and packed as pairOf would read them.
__device__ __forceinline__ uint32_t packRounded(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  uint32_t v;
  std::memcpy(&v, &p, 4);
  return v;
}

// Two 8 x 8 bf16 matrices from shared memory, transposed (ldmatrix): the rows' addresses from
// lanes 0-7 and 8-15.
__device__ __forceinline__ void loadTransposed(uint32_t& r0, uint32_t& r1, const void* row) {
  const unsigned at = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(at));
}

}  // namespace bulkhead::cuda
