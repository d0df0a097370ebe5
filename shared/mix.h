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

// splitmix64: a well-mixed 64-bit value from any 64-bit input.
BULKHEAD_HOST_DEVICE constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace bulkhead
