// Bit-mixing functions with one definition for host and device code (this header is plain C++17
// so nvcc can include it): the checksum's per-word term, and splitmix64 for counter-based
// random numbers.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define BULKHEAD_HOST_DEVICE __host__ __device__
#else
#define BULKHEAD_HOST_DEVICE
#endif

namespace bulkhead {

// One 32-bit word's contribution to a checksum (shared/checksum.h): murmur3's finaliser of the
// word mixed with its index, a bijection in the word.
BULKHEAD_HOST_DEVICE constexpr uint32_t checksumTerm(uint32_t word, uint32_t index) {
  uint32_t t = (word ^ (index * 0x9e3779b1u)) * 0x85ebca77u;
  t ^= t >> 13;
  t *= 0xc2b2ae3du;
  t ^= t >> 16;
  return t;
}

// One 32-bit weight word's term in the in-step fold of the words a kernel reads
// (shared/checksum.h foldWeightRow): the salted word times an odd multiplier that depends on its
// index, as a 64-bit product. A flipped bit b changes the term by 2^b times an odd number below
// 2^32, never 0 mod 2^64, so one flip always changes the sum; two flips cancel only if they hit
// the same bit of the same word. On the device it is one wide multiply-add per word (the CUDA
// product kernel folds on the tensor cores instead: cuda/gemm.cuh productFold).
BULKHEAD_HOST_DEVICE constexpr uint64_t foldWordTerm(uint32_t word, uint32_t salt, uint32_t index) {
  return uint64_t(word ^ salt) * uint64_t(2u * index + 1u);
}

// splitmix64: a well-mixed 64-bit value from any 64-bit input.
BULKHEAD_HOST_DEVICE constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace bulkhead
