// The inner loops of the PagedAttention kernel over one contiguous (block, head) tile of K or V: float, fp16
// or int8 elements, converted as they are loaded. Every function takes any length n / head_dim D: the SIMD
// body covers multiples of 8 and a scalar tail the rest.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace kiln {

// Eight consecutive pool elements as floats (int8 values as they are: the per-head steps are applied by the
// caller, outside the loops). The attention loops read fp16/int8 tiles through these directly: converting a
// tile into a float buffer first cost a store and a reload of every element.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Ort::Float16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float to_float(float x) { return x; }
inline float to_float(Ort::Float16_t x) { return _cvtsh_ss(x.val); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

inline void scaled_copy(float* dst, const float* src, float scale, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
}

template <typename T>
inline float dot_tail(const float* q, const T* k, int64_t from, int64_t D) {
  float s = 0.f;
  for (int64_t d = from; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// S[r][j] = q[r] . K[j] for r < NR, j < n (K rows of length D, contiguous, float/fp16/int8), NS keys at a
// time: the NR x NS accumulators share every q and K load, and each K vector is converted once for all NR rows
// (NR=4, NS=2: 2 K + 4 q loads per 8 FMAs; NR=3, NS=4: 4 + 3 per 12).
template <int NR, int NS, typename T>
inline void dot_rows(const float* const* q, const T* K, int n, int64_t D, float* const* S, const Prefetch& pf) {
  static_assert((NS == 4) || (NS == 2 && NR % 2 == 0), "NS is 4, or 2 with an even NR");
  const int64_t D8 = D & ~int64_t(7);
  const int64_t pf_chunk = pf.chunk(n / NS);
  int j = 0;
  for (; j + NS <= n; j += NS) {
    pf.step(j / NS, pf_chunk);
    const T* k0 = K + j * D;
    __m256 a[NR][NS];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NS; ++i) a[r][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      __m256 kv[NS];
      for (int i = 0; i < NS; ++i) kv[i] = load8(k0 + i * D + d);
      for (int r = 0; r < NR; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        for (int i = 0; i < NS; ++i) a[r][i] = _mm256_fmadd_ps(qv, kv[i], a[r][i]);
      }
    }
    if constexpr (NS == 4) {
      for (int r = 0; r < NR; ++r) _mm_storeu_ps(S[r] + j, hsum4(a[r][0], a[r][1], a[r][2], a[r][NS - 1]));
    } else {
      for (int r = 0; r < NR; r += 2) {
        alignas(16) float t[4];
        _mm_store_ps(t, hsum4(a[r][0], a[r][NS - 1], a[r + 1][0], a[r + 1][NS - 1]));
        S[r][j] = t[0], S[r][j + 1] = t[1], S[r + 1][j] = t[2], S[r + 1][j + 1] = t[3];
      }
    }
    if (D8 < D)
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < NS; ++i) S[r][j + i] += dot_tail(q[r], k0 + i * D, D8, D);
  }
  for (; j < n; ++j) {
    const T* k = K + j * D;
    for (int r = 0; r < NR; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), load8(k + d), a);
      S[r][j] = hsum(a) + dot_tail(q[r], k, D8, D);
    }
  }
}

inline float max_of(const float* s, int n) {
  int j = 0;
  float mx = s[0];
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    mx = hmax(m);
  }
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[j] = exp(s[j] - m) in place; returns the sum.
inline float exp_shift_sum(float* s, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  if (j < n) {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = j; i < n; ++i) tmp[i - j] = s[i] - m;
    alignas(32) float e[8];
    _mm256_store_ps(e, exp256(_mm256_load_ps(tmp)));
    for (int i = j; i < n; ++i) {
      s[i] = e[i - j];
      sum += e[i - j];
    }
  }
  return sum;
}

// acc[r] += sum_j p[r][j] * V[j] for r < NR (V float/fp16/int8): each V load, converted once, feeds NR rows.
template <int NR, typename T>
inline void accumulate_rows(float* const* acc, const float* const* p, const T* V, int n, int64_t D, const Prefetch& pf) {
  const int64_t pf_chunk = pf.chunk(D / 16);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    pf.step(d / 16, pf_chunk);
    __m256 a[NR][2];
    for (int r = 0; r < NR; ++r) a[r][0] = _mm256_loadu_ps(acc[r] + d), a[r][1] = _mm256_loadu_ps(acc[r] + d + 8);
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = load8(V + j * D + d), v1 = load8(V + j * D + d + 8);
      for (int r = 0; r < NR; ++r) {
        const __m256 pj = _mm256_broadcast_ss(p[r] + j);
        a[r][0] = _mm256_fmadd_ps(pj, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pj, v1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc[r] + d, a[r][0]), _mm256_storeu_ps(acc[r] + d + 8, a[r][1]);
  }
  for (; d + 8 <= D; d += 8) {
    for (int r = 0; r < NR; ++r) {
      __m256 a = _mm256_loadu_ps(acc[r] + d);
      for (int j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + j), load8(V + j * D + d), a);
      _mm256_storeu_ps(acc[r] + d, a);
    }
  }
  for (; d < D; ++d) {
    for (int r = 0; r < NR; ++r) {
      float a = acc[r][d];
      for (int j = 0; j < n; ++j) a += p[r][j] * to_float(V[j * D + d]);
      acc[r][d] = a;
    }
  }
}

constexpr int kTileMax = 4;  // most blocks accumulate_rows4 takes at once

// ---- four rows over keys that all of them see, scores interleaved: s[4 j + r] is row r's score of key j

// s[4 j + r] = q[r] . K[j] for j < n, three keys at a time: 12 accumulators share each q load (4 q loads per 12
// FMAs; dot_rows<4, 2>'s 4 per 8 made q.k bound by its loads), each K vector converted once for the 4 rows, and
// each key's 4 scores summed into one vector and stored at once. Then pairs, then a last key.
template <typename T>
inline void dot_rows4(const float* const* q, const T* K, int n, int64_t D, float* s, const Prefetch& pf) {
  const int64_t D8 = D & ~int64_t(7);
  const int64_t pf_chunk = pf.chunk(n / 3);
  int j = 0;
  for (; j + 3 <= n; j += 3) {
    pf.step(j / 3, pf_chunk);
    const T* k0 = K + j * D;
    __m256 a[4][3];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = a[r][2] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 k0v = load8(k0 + d), k1v = load8(k0 + D + d), k2v = load8(k0 + 2 * D + d);
      for (int r = 0; r < 4; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        a[r][0] = _mm256_fmadd_ps(qv, k0v, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1v, a[r][1]);
        a[r][2] = _mm256_fmadd_ps(qv, k2v, a[r][2]);
      }
    }
    for (int i = 0; i < 3; ++i) _mm_storeu_ps(s + 4 * (j + i), hsum4(a[0][i], a[1][i], a[2][i], a[3][i]));
    if (D8 < D)
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < 3; ++i) s[4 * (j + i) + r] += dot_tail(q[r], k0 + i * D, D8, D);
  }
  for (; j < n; ++j) {
    const T* k = K + j * D;
    __m256 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 kv = load8(k + d);
      for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), kv, a[r]);
    }
    _mm_storeu_ps(s + 4 * j, hsum4(a[0], a[1], a[2], a[3]));
    for (int r = 0; r < 4; ++r) s[4 * j + r] += dot_tail(q[r], k, D8, D);
  }
}

// Per-row maxima [4] of the interleaved scores s[4 j + r], j < n (n >= 1).
inline __m128 max_rows4(const float* s, int n) {
  __m128 m = _mm_loadu_ps(s);
  int j = 1;
  if (n >= 3) {
    __m256 v = _mm256_loadu_ps(s + 4);
    for (j = 3; j + 2 <= n; j += 2) v = _mm256_max_ps(v, _mm256_loadu_ps(s + 4 * j));
    m = _mm_max_ps(m, _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  }
  for (; j < n; ++j) m = _mm_max_ps(m, _mm_loadu_ps(s + 4 * j));
  return m;
}

// s[4 j + r] = exp(s[4 j + r] - m[r]) in place; returns the per-row sums [4].
inline __m128 exp_shift_sum4(float* s, int n, __m128 m) {
  const __m256 vm = _mm256_set_m128(m, m);
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + 4 * j), vm));
    _mm256_storeu_ps(s + 4 * j, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  if (j < n) {
    const __m128 e = _mm256_castps256_ps128(exp256(_mm256_set_m128(_mm_setzero_ps(), _mm_sub_ps(_mm_loadu_ps(s + 4 * j), m))));
    _mm_storeu_ps(s + 4 * j, e);
    sum = _mm_add_ps(sum, e);
  }
  return sum;
}

// acc[r] += sum_j s[4 j + r] * V[j] for r < 4, the keys j of nb blocks one after the other (block b: ns[b] rows at
// Vs[b]): accumulate_rows<4> with the interleaved probabilities, the accumulators held in registers across blocks.
// pfs[b] (one per block) is fetched a step per 16 dims.
template <typename T>
inline void accumulate_rows4(float* const* acc, const float* s, const T* const* Vs, const int* ns, int nb, int64_t D,
                             const Prefetch* pfs) {
  int64_t pf_chunk[kTileMax];
  for (int b = 0; b < nb; ++b) pf_chunk[b] = pfs[b].chunk(D / 16);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = _mm256_loadu_ps(acc[r] + d), a[r][1] = _mm256_loadu_ps(acc[r] + d + 8);
    const float* p = s;
    for (int b = 0; b < nb; p += 4 * ns[b], ++b) {
      pfs[b].step(d / 16, pf_chunk[b]);
      const T* V = Vs[b];
      for (int j = 0; j < ns[b]; ++j) {
        const __m256 v0 = load8(V + j * D + d), v1 = load8(V + j * D + d + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 pj = _mm256_broadcast_ss(p + 4 * j + r);
          a[r][0] = _mm256_fmadd_ps(pj, v0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(pj, v1, a[r][1]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) _mm256_storeu_ps(acc[r] + d, a[r][0]), _mm256_storeu_ps(acc[r] + d + 8, a[r][1]);
  }
  const float* p = s;
  for (int b = 0; b < nb; p += 4 * ns[b], ++b) {
    const T* V = Vs[b];
    const int n = ns[b];
    for (int64_t e = d; e + 8 <= D; e += 8) {
      for (int r = 0; r < 4; ++r) {
        __m256 a = _mm256_loadu_ps(acc[r] + e);
        for (int j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 4 * j + r), load8(V + j * D + e), a);
        _mm256_storeu_ps(acc[r] + e, a);
      }
    }
    for (int64_t e = d + ((D - d) & ~int64_t(7)); e < D; ++e) {
      for (int r = 0; r < 4; ++r) {
        float a = acc[r][e];
        for (int j = 0; j < n; ++j) a += p[4 * j + r] * to_float(V[j * D + e]);
        acc[r][e] = a;
      }
    }
  }
}

// s[j] = cap * tanh(s[j] / cap): Gemma 2's attention logit soft-cap, on the scaled scores before the softmax.
// tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (exp256's domain), the sign put back: absolute error
// ~1e-7 of the cap, against 8 std::tanh calls per vector (a scalar loop cost decode ~8% at head_dim 256).
inline void soft_cap(float* s, int n, float cap) {
  const __m256 vcap = _mm256_set1_ps(cap), minus_two = _mm256_set1_ps(-2.f), one = _mm256_set1_ps(1.f);
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(s + j), vcap);  // divided, as transformers computes it
    const __m256 e = exp256(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign_bit, y)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(vcap, _mm256_or_ps(t, _mm256_and_ps(y, sign_bit))));
  }
  for (; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

}  // namespace kiln
