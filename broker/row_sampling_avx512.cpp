// The AVX-512 passes of the row sampler: see row_sampling_avx512.h.
#include "broker/row_sampling_avx512.h"

#include <immintrin.h>

#include <algorithm>

namespace bulkhead::avx512 {
namespace {

// exp8 (vector_exp.h) over sixteen floats with x <= 0 (or -inf), as every caller here has it (a
// value less its row's or chunk's maximum): the same result bits. exp8's clamps change nothing
// there: x is never above 88.7, and a lane below -87.33 is zeroed whatever its arithmetic gives
// (-inf's NaN included), so they are left out.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  const __m512 kLo = _mm512_set1_ps(-87.33f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, kLo, _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  // exp8 scales by 2^n in two multiplies, each exact but the last, which rounds y * 2^n once
  // (also into the subnormals); scalef rounds the same exact product once: the same bits.
  const __m512 result = _mm512_scalef_ps(y, n);
  return _mm512_maskz_mov_ps(_knot_mask16(underflow), result);
}

// The masses of eight weights, each still carrying the bits of 2^52: round(e * 2^40) by the same
// trick as biasedMass4 (row_sampling.cpp), the multiply and the add in one fused operation (the
// product is exact, so it rounds the same). Sums of these lanes are corrected once at the end:
// sixteen weights carry 16 * kMassBias.
__attribute__((target("avx512f"))) inline __m512i biasedMass8(__m256 e) {
  return _mm512_castpd_si512(
      _mm512_fmadd_pd(_mm512_cvtps_pd(e), _mm512_set1_pd(0x1p40), _mm512_set1_pd(0x1p52)));
}

__attribute__((target("avx512f"))) inline __m512i biasedMass16Sum(__m512 e) {
  return _mm512_add_epi64(
      biasedMass8(_mm512_castps512_ps256(e)),
      biasedMass8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
}

constexpr uint64_t kMassBias = 0x4330000000000000ull;  // the bits of 2^52

// The eight 64-bit lanes added modulo 2^64 (_mm512_reduce_add_epi64 adds them as signed
// integers, which overflow, undefined, on biased masses).
__attribute__((target("avx512f"))) inline uint64_t sumLanes(__m512i v) {
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, v);
  uint64_t total = 0;
  for (const uint64_t l : lanes) total += l;
  return total;
}

}  // namespace

__attribute__((target("avx512f"))) ReadTotals readSixteens(const float* src, float* dst,
                                                           uint32_t count, uint32_t base, bool copy,
                                                           bool track) {
  __m512i keyed = _mm512_mullo_epi32(
      _mm512_add_epi32(_mm512_set1_epi32(int(base)),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
      _mm512_set1_epi32(int(kGolden)));
  const __m512i keyed_step = _mm512_set1_epi32(int(16 * kGolden));
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  const __m512i low32 = _mm512_set1_epi64(0xffffffffll);
  __m512i sum = _mm512_setzero_si512();
  __mmask16 bad = 0;
  // Two sets of maxima, even and odd vectors, so that neither waits for the other's compare: one
  // set's compare and select would hold every vector for their latency.
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i index_step = _mm512_set1_epi32(32);
  __m512 best[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
  __m512i index[2] = {lane, _mm512_add_epi32(lane, _mm512_set1_epi32(16))};
  __m512i best_index[2] = {index[0], index[1]};
  auto take = [&](uint32_t i, int set) __attribute__((target("avx512f"))) {
    const __m512 v = _mm512_loadu_ps(src + i);
    if (copy) _mm512_storeu_ps(dst + i, v);
    const __m512i w = _mm512_castps_si512(v);
    __m512i t = _mm512_mullo_epi32(_mm512_xor_si512(w, keyed), _mm512_set1_epi32(int(0x85ebca77u)));
    keyed = _mm512_add_epi32(keyed, keyed_step);
    t = _mm512_xor_si512(t, _mm512_srli_epi32(t, 13));
    t = _mm512_mullo_epi32(t, _mm512_set1_epi32(int(0xc2b2ae3du)));
    t = _mm512_xor_si512(t, _mm512_srli_epi32(t, 16));
    sum = _mm512_add_epi64(sum, _mm512_and_si512(t, low32));
    sum = _mm512_add_epi64(sum, _mm512_srli_epi64(t, 32));
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(w, exponent), exponent);
    if (track) {
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best[set], _CMP_GT_OQ);
      best[set] = _mm512_mask_mov_ps(best[set], larger, v);
      best_index[set] = _mm512_mask_mov_epi32(best_index[set], larger, index[set]);
      index[set] = _mm512_add_epi32(index[set], index_step);
    } else {
      best[set] = _mm512_max_ps(best[set], v);
    }
  };
  uint32_t i = 0;
  for (; i + 32 <= 16 * count; i += 32) {
    take(i, 0);
    take(i + 16, 1);
  }
  if (i < 16 * count) take(i, 0);
  ReadTotals totals;
  totals.checksum = sumLanes(sum);
  totals.non_finite = bad != 0;
  totals.max = std::max(_mm512_reduce_max_ps(best[0]), _mm512_reduce_max_ps(best[1]));
  if (track) {
    // The lowest index among the lanes of either set holding the max (each lane keeps the first
    // of its largest values, so the lowest of those is the row's first).
    const __m512 at = _mm512_set1_ps(totals.max);
    totals.arg = std::min(uint32_t(_mm512_mask_reduce_min_epu32(
                              _mm512_cmp_ps_mask(best[0], at, _CMP_EQ_OQ), best_index[0])),
                          uint32_t(_mm512_mask_reduce_min_epu32(
                              _mm512_cmp_ps_mask(best[1], at, _CMP_EQ_OQ), best_index[1])));
  }
  return totals;
}

__attribute__((target("avx512f"))) WeightsTotals weightsSixteens(const float* src, float* dst,
                                                                 uint32_t count, float m,
                                                                 float scale) {
  const __m512 vm = _mm512_set1_ps(m), vscale = _mm512_set1_ps(scale);
  __m512i mass = _mm512_setzero_si512(), max_key = _mm512_setzero_si512();
  for (uint32_t i = 0; i < 16 * count; i += 16) {
    const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(src + i), vm), vscale));
    _mm512_storeu_ps(dst + i, e);
    mass = _mm512_add_epi64(mass, biasedMass16Sum(e));
    max_key = _mm512_max_epi32(max_key, _mm512_castps_si512(e));  // non-negative: bits order
  }
  return {sumLanes(mass) - uint64_t(16) * count * kMassBias,
          uint32_t(_mm512_reduce_max_epi32(max_key))};
}

__attribute__((target("avx512f"))) void expSumSixteens(const float* src, uint32_t count, float m,
                                                       float (&acc)[8]) {
  const __m512 vm = _mm512_set1_ps(m);
  __m256 sum = _mm256_loadu_ps(acc);
  for (uint32_t i = 0; i < 16 * count; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(src + i), vm));
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
    sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  _mm256_storeu_ps(acc, sum);
}

__attribute__((target("avx512f"))) KeptTotals keptSixteens(const float* w, uint32_t count,
                                                           uint32_t base, uint32_t cut_key,
                                                           uint32_t cut_id) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i key = _mm512_set1_epi32(int(cut_key)), id_cut = _mm512_set1_epi32(int(cut_id));
  __m512i mass = _mm512_setzero_si512();
  KeptTotals totals;
  for (uint32_t i = 0; i < 16 * count; i += 16) {
    const __m512 e = _mm512_loadu_ps(w + i);
    const __m512i k = _mm512_castps_si512(e);
    const __m512i id = _mm512_add_epi32(_mm512_set1_epi32(int(base + i)), lane);
    const __mmask16 kept = _mm512_cmpgt_epi32_mask(k, key) |
                           (_mm512_cmpeq_epi32_mask(k, key) & ~_mm512_cmpgt_epi32_mask(id, id_cut));
    totals.count += uint32_t(__builtin_popcount(unsigned(kept)));
    mass = _mm512_add_epi64(mass, biasedMass16Sum(_mm512_maskz_mov_ps(kept, e)));
  }
  totals.mass = sumLanes(mass) - uint64_t(16) * count * kMassBias;
  return totals;
}

}  // namespace bulkhead::avx512
