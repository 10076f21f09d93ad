// SIMD arithmetic of the sampler's row kernels (sampling.cc): loads, exp in float64 and float32, weights,
// the row max. Each function takes any length n: lanes past n read -inf.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kiln_sampling {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Eight logits from i on; lanes past n read -inf.
inline __m256 load8(const float* x, int64_t i, int64_t n) {
  if (i + 8 <= n) return _mm256_loadu_ps(x + i);
  alignas(32) float tail[8];
  for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? x[i + j] : kNegInf;
  return _mm256_load_ps(tail);
}

// exp(x) for x <= 0 in float64 (about 1 ulp); 0 below -708 (where exp is subnormal) and for -inf/NaN.
inline __m256d exp_pd(__m256d x) {
  const __m256d lowest = _mm256_set1_pd(-708.0);
  const __m256d keep = _mm256_cmp_pd(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_pd(x, lowest);
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);  // |r| <= ln2 / 2
  // Taylor series to r^12 (truncation below 2e-16 relative on |r| <= 0.347), by Estrin's scheme: a
  // short dependency chain, so the loops' independent exps overlap.
  const auto c = [](double v) { return _mm256_set1_pd(v); };
  const __m256d r2 = _mm256_mul_pd(r, r), r4 = _mm256_mul_pd(r2, r2), r8 = _mm256_mul_pd(r4, r4);
  const __m256d q0 = _mm256_fmadd_pd(r, c(1.0), c(1.0)), q1 = _mm256_fmadd_pd(r, c(1.0 / 6), c(1.0 / 2));
  const __m256d q2 = _mm256_fmadd_pd(r, c(1.0 / 120), c(1.0 / 24));
  const __m256d q3 = _mm256_fmadd_pd(r, c(1.0 / 5040), c(1.0 / 720));
  const __m256d q4 = _mm256_fmadd_pd(r, c(1.0 / 362880), c(1.0 / 40320));
  const __m256d q5 = _mm256_fmadd_pd(r, c(1.0 / 39916800), c(1.0 / 3628800));
  const __m256d s0 = _mm256_fmadd_pd(q1, r2, q0), s1 = _mm256_fmadd_pd(q3, r2, q2);
  const __m256d s2 = _mm256_fmadd_pd(c(1.0 / 479001600), r4, _mm256_fmadd_pd(q5, r2, q4));
  const __m256d p = _mm256_fmadd_pd(s2, r8, _mm256_fmadd_pd(s1, r4, s0));
  const __m128i ni = _mm256_cvtpd_epi32(n);  // in [-1022, 0]
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(ni), _mm256_set1_epi64x(1023)), 52);
  return _mm256_and_pd(keep, _mm256_mul_pd(p, _mm256_castsi256_pd(bits)));
}

// Weights exp((x - max) * inv_t) of 8 logits (lanes 0-3 in lo, 4-7 in hi), 0 where x < threshold.
inline void weights8(__m256 x, float threshold, double max, double inv_t, __m256d& lo, __m256d& hi) {
  x = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, _mm256_cmp_ps(x, _mm256_set1_ps(threshold), _CMP_GE_OQ));
  const __m256d m = _mm256_set1_pd(max), s = _mm256_set1_pd(inv_t);
  lo = exp_pd(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), m), s));
  hi = exp_pd(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), m), s));
}

inline void weights8(__m256 x, float threshold, double max, double inv_t, double* w) {
  __m256d lo, hi;
  weights8(x, threshold, max, inv_t, lo, hi);
  _mm256_storeu_pd(w, lo);
  _mm256_storeu_pd(w + 4, hi);
}

// exp(x) for x <= 0 in float32 (Cephes' polynomial, about 1e-7 relative); 0 below -87 and for -inf/NaN.
inline __m256 exp_ps(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.f);
  const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// float32 weights exp((x - max) * inv_t) of 8 logits, 0 where x < threshold: the full-row draw's, where a
// weight's 1e-7 relative error moves a token's probability by as much (the numpy sampler's precision).
inline __m256 weights8f(__m256 x, float threshold, float max, float inv_t) {
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(threshold), _CMP_GE_OQ);
  const __m256 w = exp_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_set1_ps(max)), _mm256_set1_ps(inv_t)));
  return _mm256_and_ps(kept, w);
}

inline double weight1(float x, float threshold, double max, double inv_t) {
  alignas(32) double w[8];
  weights8(_mm256_set1_ps(x), threshold, max, inv_t, w);
  return w[0];
}

// The row's largest logit; NaN if any logit is NaN (the selections below need a total order).
inline float row_max(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
  }
  for (; i < n; i += 8) {
    const __m256 a = load8(x, i, n);
    m0 = _mm256_max_ps(m0, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan)) return std::numeric_limits<float>::quiet_NaN();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  return *std::max_element(lanes, lanes + 8);
}

// The smallest float >= v, so that x >= result exactly when x >= v for every float x.
inline float float_at_least(double v) {
  float r = static_cast<float>(v);
  if (static_cast<double>(r) < v) r = std::nextafter(r, std::numeric_limits<float>::infinity());
  return r;
}

}  // namespace kiln_sampling
