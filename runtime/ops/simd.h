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

// ---- attention rows

// Prefetch into L2 of `bytes` from p, one instruction per 64-byte line. L2, not L1: a tile ahead is as large as
// the one being computed, and fetched into L1 beside it they evicted each other (1B heads, fp16 K/V at 32k from
// DRAM, one thread: 205 -> 152 ns a cached position in benchmarks/paged_attention_compute.cc, 0.91-0.97x the op's
// time in ONNX Runtime; prefetcht2 measured the same as t1, prefetchnta no gain).
// Inline asm: GCC 12 -O3 emitted no instruction at all for the same loop of _mm_prefetch in this kernel.
inline void prefetch_l2(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) asm volatile("prefetcht1 %0" ::"m"(p[o]));
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
    if (p != nullptr && b < bytes) prefetch_l2(p + b, std::min(chunk, bytes - b));
  }
};

inline void scale_row(float* x, float s, int64_t D) {
  int64_t d = 0;
  const __m256 vs = _mm256_set1_ps(s);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(x + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), vs));
  for (; d < D; ++d) x[d] *= s;
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
