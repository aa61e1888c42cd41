// Vector math shared by the CPU kernels (quant_linear.cpp, paged_attention.cpp). Every function is
// a fixed instruction sequence per lane, so a value's bits never depend on its neighbours.
#pragma once
#include <immintrin.h>

namespace specserve {

// exp(x) for 8 lanes, x clamped to [-87, 89] (below -87 exp < 2^-125 is kept as exp(-87); from 88.8
// on the result overflows to inf as it should): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), the
// degree-7 Taylor polynomial of exp(r) (truncation < 2e-9 relative) times 2^n built in the exponent.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n in two factors, so that n = 128 (x near 89) overflows in the product, not the exponent field
  const __m256i n1 = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
  const __m256i n2 = _mm256_sub_epi32(_mm256_cvtps_epi32(n), n1);
  const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}

}  // namespace specserve
