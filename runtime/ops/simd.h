// AVX2/FMA/F16C building blocks of the PagedAttention kernel. Every function takes any
// length n / head_dim D: the SIMD body covers multiples of 8 and a scalar tail the rest.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "onnxruntime_cxx_api.h"

namespace kiln {

template <typename KvT>
constexpr bool is_f16() { return std::is_same<KvT, Ort::Float16_t>::value; }

template <typename KvT>
constexpr bool is_int8() { return std::is_same<KvT, int8_t>::value; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of v's lanes (max_ps order: on a NaN lane the result depends on the lane's place).
inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Cephes-style exp for x <= 0 (inputs are clamped to [-87, 0]); relative error ~1e-7.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_setzero_ps());
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// ---- KV element conversion

// store_row(dst, src, n, scale): `scale` is the int8 pool's quantization step; float pools ignore it.
inline void store_row(float* dst, const float* src, int64_t n, float) { std::memcpy(dst, src, n * sizeof(float)); }

inline void store_row(Ort::Float16_t* dst, const float* src, int64_t n, float) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// int8: q = clamp(round_half_even(x / scale), -127, 127) (x / scale divided, as the numpy reference does).
inline void store_row(int8_t* dst, const float* src, int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
  }
  for (; i < n; ++i) dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(src[i] / scale))));
}

// A float view of n pool elements: the pool itself for fp32, `buf` converted for fp16 and int8
// (int8 values as they are: the per-head scales are applied by the caller, outside the loops).
inline const float* as_float(const float* src, float*, int64_t) { return src; }

inline const float* as_float(const Ort::Float16_t* src, float* buf, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) buf[i] = _cvtsh_ss(s[i]);
  return buf;
}

inline const float* as_float(const int8_t* src, float* buf, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    _mm256_storeu_ps(buf + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
  }
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))));
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

// ---- attention rows

// Prefetch into L1 of `bytes` from p, one instruction per 64-byte line. Inline asm: GCC 12 -O3
// emitted no instruction at all for the same loop of _mm_prefetch in this kernel.
inline void prefetch_l1(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) asm volatile("prefetcht0 %0" ::"m"(p[o]));
}

// A tile to fetch while the current one is computed, spread over `steps` loop iterations so that
// the misses in flight stay within the core's miss buffers (a whole tile at once stalls it).
struct Prefetch {
  const char* p = nullptr;
  int64_t bytes = 0;
  // Bytes per step (whole lines) for `steps` steps; computed once per loop, outside it.
  int64_t chunk(int64_t steps) const { return steps > 0 ? ((bytes + steps - 1) / steps + 63) & ~int64_t(63) : 0; }
  void step(int64_t i, int64_t chunk) const {
    const int64_t b = i * chunk;
    if (p != nullptr && b < bytes) prefetch_l1(p + b, std::min(chunk, bytes - b));
  }
};

inline void scaled_copy(float* dst, const float* src, float scale, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
}

inline void scale_row(float* x, float s, int64_t D) {
  int64_t d = 0;
  const __m256 vs = _mm256_set1_ps(s);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(x + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), vs));
  for (; d < D; ++d) x[d] *= s;
}

inline float dot_tail(const float* q, const float* k, int64_t from, int64_t D) {
  float s = 0.f;
  for (int64_t d = from; d < D; ++d) s += q[d] * k[d];
  return s;
}

// S[r][j] = q[r] . K[j] for r < NR, j < n (K rows of length D, contiguous), NS keys at a
// time: the NR x NS accumulators share every q and K load (NR=3, NS=4: 7 loads per 12 FMAs).
template <int NR, int NS = 4>
inline void dot_rows(const float* const* q, const float* K, int n, int64_t D, float* const* S, const Prefetch& pf) {
  static_assert(NS == 2 || NS == 4, "NS is 2 or 4");
  const int64_t D8 = D & ~int64_t(7);
  const int64_t pf_chunk = pf.chunk(n / NS);
  int j = 0;
  for (; j + NS <= n; j += NS) {
    pf.step(j / NS, pf_chunk);
    const float* k0 = K + j * D;
    __m256 a[NR][NS];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NS; ++i) a[r][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      __m256 kv[NS];
      for (int i = 0; i < NS; ++i) kv[i] = _mm256_loadu_ps(k0 + i * D + d);
      for (int r = 0; r < NR; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        for (int i = 0; i < NS; ++i) a[r][i] = _mm256_fmadd_ps(qv, kv[i], a[r][i]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      if (NS == 4) {
        _mm_storeu_ps(S[r] + j, hsum4(a[r][0], a[r][1], a[r][2], a[r][NS - 1]));
      } else {
        S[r][j] = hsum(a[r][0]);
        S[r][j + 1] = hsum(a[r][NS - 1]);
      }
      if (D8 < D)
        for (int i = 0; i < NS; ++i) S[r][j + i] += dot_tail(q[r], k0 + i * D, D8, D);
    }
  }
  for (; j < n; ++j) {
    const float* k = K + j * D;
    for (int r = 0; r < NR; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), _mm256_loadu_ps(k + d), a);
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

// acc[r] += sum_j p[r][j] * V[j] for r < NR: each V load feeds NR rows.
template <int NR>
inline void accumulate_rows(float* const* acc, const float* const* p, const float* V, int n, int64_t D, const Prefetch& pf) {
  const int64_t pf_chunk = pf.chunk(D / 16);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    pf.step(d / 16, pf_chunk);
    __m256 a[NR][2];
    for (int r = 0; r < NR; ++r) a[r][0] = _mm256_loadu_ps(acc[r] + d), a[r][1] = _mm256_loadu_ps(acc[r] + d + 8);
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(V + j * D + d), v1 = _mm256_loadu_ps(V + j * D + d + 8);
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
      for (int j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + j), _mm256_loadu_ps(V + j * D + d), a);
      _mm256_storeu_ps(acc[r] + d, a);
    }
  }
  for (; d < D; ++d) {
    for (int r = 0; r < NR; ++r) {
      float a = acc[r][d];
      for (int j = 0; j < n; ++j) a += p[r][j] * V[j * D + d];
      acc[r][d] = a;
    }
  }
}

// ---- rotary embedding

// dst [D] = src rotated by RoPE with one position's cos/sin [half]: rotary dims R = 2 * half <= D, the rest
// copied. Pairs (j, j + half) as Hugging Face's rotate_half, or (2j, 2j + 1) when interleaved; each pair
// (a, b) -> (a c - b s, b c + a s).
inline void rotate_row(float* dst, const float* src, const float* cos, const float* sin, int64_t half, int64_t D,
                       bool interleaved) {
  int64_t j = 0;
  if (interleaved) {
    for (; j < half; ++j) {
      const float a = src[2 * j], b = src[2 * j + 1];
      dst[2 * j] = a * cos[j] - b * sin[j];
      dst[2 * j + 1] = b * cos[j] + a * sin[j];
    }
  } else {
    for (; j + 8 <= half; j += 8) {
      const __m256 a = _mm256_loadu_ps(src + j), b = _mm256_loadu_ps(src + half + j);
      const __m256 c = _mm256_loadu_ps(cos + j), s = _mm256_loadu_ps(sin + j);
      _mm256_storeu_ps(dst + j, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(dst + half + j, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
    }
    for (; j < half; ++j) {
      const float a = src[j], b = src[half + j];
      dst[j] = a * cos[j] - b * sin[j];
      dst[half + j] = b * cos[j] + a * sin[j];
    }
  }
  if (D > 2 * half) std::memcpy(dst + 2 * half, src + 2 * half, (D - 2 * half) * sizeof(float));
}

}  // namespace kiln
