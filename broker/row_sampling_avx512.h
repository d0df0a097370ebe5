// The row sampler's passes over whole vectors of 16 floats, for processors with AVX-512
// (row_sampling.cpp runs them where __builtin_cpu_supports says so, and its 8-lane loops take the
// rest of each chunk). Each gives the same sums, flags, maxima and exp bits as the 8-lane loop it
// continues: integer sums and maxima do not depend on the grouping, and exp16 is exp8 lane by
// lane. Kept in a file of their own, built with GCC's uninitialised-value warnings off: its
// AVX-512 intrinsics start results from _mm512_undefined_*, which those warnings misread once
// inlined.
#pragma once

#include <cmath>
#include <cstdint>

namespace bulkhead::avx512 {

inline constexpr uint32_t kGolden = 0x9e3779b1u;  // the checksum's index key (mix.h checksumTerm)

struct ReadTotals {
  uint64_t checksum = 0;
  bool non_finite = false;
  float max = -INFINITY;
  uint32_t arg = 0;  // with `track`: the first index of the max, from base
};

// The read pass over `count` vectors of 16 from id `base`: checksum terms, finiteness and max,
// copied to dst when `copy`. With `track` each lane keeps the first index of its largest value,
// for rows sampled greedily without a copy (the index comes from the values verified, not from a
// second read).
ReadTotals readSixteens(const float* src, float* dst, uint32_t count, uint32_t base, bool copy,
                        bool track);

struct WeightsTotals {
  uint64_t mass = 0;
  uint32_t max_key = 0;  // the bits of the largest e (every e lies in [0, 1])
};

// The weights pass over `count` vectors of 16: e = exp((x - m) * scale) stored, their mass and
// the largest one's bits.
WeightsTotals weightsSixteens(const float* src, float* dst, uint32_t count, float m, float scale);

// The log-sum-exp pass over `count` vectors of 16: adds exp(x - m) into the 8 lanes of `acc`, a
// vector's first 8 values and then its last 8, as the 8-lane loop adds them (the same bits).
void expSumSixteens(const float* src, uint32_t count, float m, float (&acc)[8]);

struct KeptTotals {
  uint64_t mass = 0;
  uint32_t count = 0;
};

// The kept pass over `count` vectors of 16 from id `base`: the count and mass of the weights w
// kept ({key > cut_key} + {key == cut_key and id <= cut_id}).
KeptTotals keptSixteens(const float* w, uint32_t count, uint32_t base, uint32_t cut_key,
                        uint32_t cut_id);

}  // namespace bulkhead::avx512
