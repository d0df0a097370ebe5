// exp over eight floats at once, for the sampler's weights and log-sum-exp. One definition for
// every lane and every tail (tails run through it padded), so a value's exp never depends on
// where in a row it sits or on which thread computed it.
#pragma once

#include <immintrin.h>

namespace bulkhead {

// exp(x) per lane, within 2 ulp for results >= 2^-126; inputs below -87.33 give 0, above 88.7
// give +inf. exp(0) is exactly 1. Cody-Waite range reduction by ln 2, then a degree-6
// polynomial (Cephes' expf coefficients) in fused multiply-adds.
inline __m256 exp8(__m256 x) {
  const __m256 kHi = _mm256_set1_ps(88.7f);
  const __m256 kLo = _mm256_set1_ps(-87.33f);
  const __m256 underflow = _mm256_cmp_ps(x, kLo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, kLo), kHi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  // 2^n in two halves so n = 128 (x near 88.7) still scales without overflowing the exponent.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 s1 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  const __m256 result = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
  return _mm256_andnot_ps(underflow, result);
}

// One value through the same eight-lane code.
inline float exp1(float x) {
  return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)));
}

}  // namespace bulkhead
