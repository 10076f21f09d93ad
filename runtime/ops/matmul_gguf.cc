// kiln.MatMulGGUF (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (attribute, inputs, the blocks' layouts, semantics) is written once, with its numpy reference, in
// kiln/matmul_gguf.py and kiln/gguf_blocks.py; this file implements it.
//
// The weights are the file's blocks as they are: nothing is repacked, so the engine holds them once (mapped from its
// data file). Activations stay float32. A tile is one output channel x up to kTileRows rows; for each block it
// decodes the block's integers to float32 vectors once (8 weights a vector), then for each row multiplies them into
// the row's x and adds the product to that row's accumulator, one sub-block scale at a time:
//     acc += (d * sc_j) * (q_j . x_j)          and, for the types with minimums (Q4_K, Q5_K; Q5_1 below),
//     macc += (dmin * m_j) * sum(x_j)          8 sub-blocks' minimums in one vector against the row's 32-sums
// y = sum(acc) - sum(macc). The scale products d * sc_j are the spec's float32 numbers; only the order of the sums
// differs from x @ dequantize(W)^T (docs/design.md, "kiln.MatMulGGUF"). Each row's arithmetic is the same in every
// tile size, so a row's outputs are bitwise the same for every T (speculative verification reproduces decode's).
//
// Work items (chunks of channels x chunks of rows) run on ONNX Runtime's intra-op thread pool. Written with AVX2
// intrinsics; the AVX-512 VNNI library (build_ops.py) compiles the same code (more registers, no new path).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "matmul_gguf.h"
#include "matmul_gguf_int8.h"
#include "parallel_for.h"
#include "gguf_records.h"
#include "shape_text.h"
#include "simd.h"
#include "weight_layout.h"

namespace kiln {
namespace {

constexpr int kTileRows = 4;             // rows a tile: 2 accumulators a row + 4 decoded vectors fit 16 ymm
constexpr int64_t kChannelsPerItem = 16;
constexpr int64_t kRowsPerItem = 32;
constexpr int64_t kSub = 32;             // weights per minimum (Q4_K, Q5_K, Q5_1): the row sums' granularity

[[noreturn]] void fail_gguf(const std::string& msg) {
  throw Ort::Exception("kiln.MatMulGGUF: " + msg, ORT_INVALID_ARGUMENT);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// 8 bytes at p, each widened to an int32 lane
inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }

// For each row r: acc[r] += scale * (q[0..count) . x[r][off .. off + 8 count)).
template <int NT>
__attribute__((always_inline)) inline void dot_add(const __m256* q, int count, const float* const* x, int64_t off,
                                                   __m256 scale, __m256* acc) {
#pragma GCC unroll 4
  for (int r = 0; r < NT; ++r) {
    __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(x[r] + off));
    for (int i = 1; i < count; ++i) p = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(x[r] + off + 8 * i), p);
    acc[r] = _mm256_fmadd_ps(scale, p, acc[r]);
  }
}

// ---- the block decoders (layouts: kiln/gguf_blocks.py). block<NT>(b, x, sums, acc, macc): x[r] points at the
// block's first weight's activation in row r, sums[r] at its first 32-sum.

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static constexpr bool kMins = false;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const*, __m256* acc, __m256*) {
    const __m256i r0 = bytes8(b + 2), r1 = bytes8(b + 10), eight = _mm256_set1_epi32(8);
    const __m256 q[4] = {to_float(_mm256_sub_epi32(low4(r0), eight)), to_float(_mm256_sub_epi32(low4(r1), eight)),
                         to_float(_mm256_sub_epi32(_mm256_srli_epi32(r0, 4), eight)),
                         to_float(_mm256_sub_epi32(_mm256_srli_epi32(r1, 4), eight))};
    dot_add<NT>(q, 4, x, 0, _mm256_set1_ps(f16(b)), acc);
  }
};

// Q5_0 / Q5_1: Q4_0's nibbles, each with a fifth bit from the block's 32-bit word (bit i: weight i).
inline void five_bit_block(const uint8_t* qh, const uint8_t* qs, __m256i centre, __m256* q) {
  uint32_t word;
  std::memcpy(&word, qh, 4);
  const __m256i bits = _mm256_set1_epi32(static_cast<int>(word)), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i r0 = bytes8(qs), r1 = bytes8(qs + 8), sixteen = _mm256_set1_epi32(16);
  const __m256i nib[4] = {low4(r0), low4(r1), _mm256_srli_epi32(r0, 4), _mm256_srli_epi32(r1, 4)};
  for (int i = 0; i < 4; ++i) {  // weights 8i .. 8i + 7: bits 8i + lane moved to bit 4
    const __m256i shift = _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * i));
    const __m256i high = _mm256_and_si256(_mm256_slli_epi32(_mm256_srlv_epi32(bits, shift), 4), sixteen);
    q[i] = to_float(_mm256_sub_epi32(_mm256_or_si256(nib[i], high), centre));
  }
}

struct Q5_0 {
  static constexpr int64_t kWeights = 32, kBytes = 22;
  static constexpr bool kMins = false;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const*, __m256* acc, __m256*) {
    __m256 q[4];
    five_bit_block(b + 2, b + 6, _mm256_set1_epi32(16), q);
    dot_add<NT>(q, 4, x, 0, _mm256_set1_ps(f16(b)), acc);
  }
};

// Q5_1's minimum m is added to each of its 32 weights: -m * sum(x) goes into lane 0 of macc (y = acc - macc).
struct Q5_1 {
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static constexpr bool kMins = true;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const* sums, __m256* acc, __m256* macc) {
    __m256 q[4];
    five_bit_block(b + 4, b + 8, _mm256_setzero_si256(), q);
    dot_add<NT>(q, 4, x, 0, _mm256_set1_ps(f16(b)), acc);
    const float m = f16(b + 2);
    for (int r = 0; r < NT; ++r) macc[r] = _mm256_add_ps(macc[r], _mm256_setr_ps(-m * sums[r][0], 0, 0, 0, 0, 0, 0, 0));
  }
};

struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static constexpr bool kMins = false;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const*, __m256* acc, __m256*) {
    __m256 q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = to_float(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i))));
    dot_add<NT>(q, 4, x, 0, _mm256_set1_ps(f16(b)), acc);
  }
};

// Q4_K / Q5_K's 6-bit scales and minimums (llama.cpp's get_scale_min_k4, unpacked with its 32-bit masks: the 12
// bytes as three words become the 8 scales and the 8 minimums, a byte each) times d and dmin, in float32 as the spec.
inline void k_scales(const uint8_t* b, float* scale, __m256* mins) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3], out[4];
  std::memcpy(w, b + 4, 12);
  out[0] = w[0] & kLow6;                                         // scales 0-3
  out[1] = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);        // scales 4-7
  out[2] = w[1] & kLow6;                                         // minimums 0-3
  out[3] = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4); // minimums 4-7
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out));
  _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(f16(b)), to_float(_mm256_cvtepu8_epi32(bytes))));
  *mins = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), to_float(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
}

// The 8 sub-blocks of a Q4_K / Q5_K block: sub-block j's 32 nibbles are the low (j even) or high (j odd) halves of
// qs[32 (j / 2) ..]; Q5_K adds bit j of qh[l] as weight l's fifth bit.
template <bool kFifthBit, int NT>
inline void k_sub_blocks(const uint8_t* b, const uint8_t* qs, const float* const* x, const float* const* sums,
                         __m256* acc, __m256* macc) {
  alignas(32) float scale[8];
  __m256 mins;
  k_scales(b, scale, &mins);
  for (int r = 0; r < NT; ++r) macc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(sums[r]), macc[r]);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * c + half;
      __m256 q[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = bytes8(qs + 32 * c + 8 * i);
        __m256i v = half ? _mm256_srli_epi32(raw, 4) : low4(raw);  // bytes widened: >> 4 is the high nibble
        if constexpr (kFifthBit) {  // bit j of the byte moved to bit 4
          const __m256i hb = bytes8(b + 16 + 8 * i);
          const __m256i moved = j <= 4 ? _mm256_sll_epi32(hb, _mm_cvtsi32_si128(4 - j))
                                       : _mm256_srl_epi32(hb, _mm_cvtsi32_si128(j - 4));
          v = _mm256_or_si256(v, _mm256_and_si256(moved, _mm256_set1_epi32(16)));
        }
        q[i] = to_float(v);
      }
      dot_add<NT>(q, 4, x, 32 * j, _mm256_set1_ps(scale[j]), acc);
    }
  }
}

struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static constexpr bool kMins = true;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const* sums, __m256* acc, __m256* macc) {
    k_sub_blocks<false, NT>(b, b + 16, x, sums, acc, macc);
  }
};

struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static constexpr bool kMins = true;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const* sums, __m256* acc, __m256* macc) {
    k_sub_blocks<true, NT>(b, b + 48, x, sums, acc, macc);
  }
};

// Q6_K: half h (128 weights) holds groups t = 0..3 of 32: low nibbles of ql[64h + 32 (t % 2) + l] >> 4 (t / 2),
// high two bits of qh[32h + l] >> 2t; q - 32; one int8 scale per 16 weights, times d. Eight bytes of a column l of
// ql's two rows and qh give that column's weights in all four groups, so each byte is loaded once.
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static constexpr bool kMins = false;
  template <int NT>
  static void block(const uint8_t* b, const float* const* x, const float* const*, __m256* acc, __m256*) {
    const float d = f16(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i centre = _mm256_set1_epi32(32), m3 = _mm256_set1_epi32(3), m48 = _mm256_set1_epi32(48);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {  // columns 0-15 (each group's first scale), then 16-31 (its second)
        __m256 q[4][2];
        for (int i = 0; i < 2; ++i) {
          const int64_t col = 16 * s + 8 * i;
          const __m256i l0 = bytes8(b + 64 * h + col), l1 = bytes8(b + 64 * h + 32 + col);
          const __m256i hb = bytes8(b + 128 + 32 * h + col);
          const __m256i v0 = _mm256_or_si256(low4(l0), _mm256_slli_epi32(_mm256_and_si256(hb, m3), 4));
          const __m256i v1 = _mm256_or_si256(low4(l1), _mm256_and_si256(_mm256_slli_epi32(hb, 2), m48));
          const __m256i v2 = _mm256_or_si256(_mm256_srli_epi32(l0, 4), _mm256_and_si256(hb, m48));
          const __m256i v3 = _mm256_or_si256(_mm256_srli_epi32(l1, 4), _mm256_and_si256(_mm256_srli_epi32(hb, 2), m48));
          q[0][i] = to_float(_mm256_sub_epi32(v0, centre));
          q[1][i] = to_float(_mm256_sub_epi32(v1, centre));
          q[2][i] = to_float(_mm256_sub_epi32(v2, centre));
          q[3][i] = to_float(_mm256_sub_epi32(v3, centre));
        }
        for (int t = 0; t < 4; ++t) {
          const int g = 4 * h + t;
          dot_add<NT>(q[t], 2, x, 32 * g + 16 * s, _mm256_set1_ps(d * static_cast<float>(scales[2 * g + s])), acc);
        }
      }
    }
  }
};

// ---- tiles and work items

struct Problem {
  const uint8_t* w;    // [N, row_bytes]
  const float* x;      // [T, K]
  const float* sums;   // [T, K / 32] sums of 32 consecutive activations (types with minimums), else nullptr
  const float* bias;   // [N] or nullptr
  float* y;            // [T, N]
  int64_t N, K, row_bytes;
};

template <class Type, int NT>
__attribute__((noinline)) void tile(const Problem& p, int64_t n, int64_t t0) {
  const uint8_t* row = p.w + n * p.row_bytes;
  const float* x[NT];
  const float* sums[NT];
  __m256 acc[NT], macc[NT];
  for (int r = 0; r < NT; ++r) {
    x[r] = p.x + (t0 + r) * p.K;
    sums[r] = Type::kMins ? p.sums + (t0 + r) * (p.K / kSub) : nullptr;
    acc[r] = macc[r] = _mm256_setzero_ps();
  }
  const int64_t blocks = p.K / Type::kWeights;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    Type::template block<NT>(row + blk * Type::kBytes, x, sums, acc, macc);
    for (int r = 0; r < NT; ++r) {
      x[r] += Type::kWeights;
      if constexpr (Type::kMins) sums[r] += Type::kWeights / kSub;
    }
  }
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int r = 0; r < NT; ++r) {
    float v = hsum(acc[r]);
    if constexpr (Type::kMins) v -= hsum(macc[r]);
    p.y[(t0 + r) * p.N + n] = v + bias;
  }
}

template <class Type, int NT>
void pass_rows(const Problem& p, int64_t n, int64_t t0, int64_t rows) {
  if constexpr (NT > 1)
    if (rows < NT) return pass_rows<Type, NT - 1>(p, n, t0, rows);
  tile<Type, NT>(p, n, t0);
}

// Rows [t_begin, t_end) x channels [n_begin, n_end): a pass of rows over every channel of the item, so the pass's
// activations stay in L1/L2 while the item's weight rows (16 x K / QK blocks) are re-read from L2.
template <class Type>
void run_item(const Problem& p, int64_t n_begin, int64_t n_end, int64_t t_begin, int64_t t_end) {
  for (int64_t t = t_begin; t < t_end; t += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, t_end - t);
    for (int64_t n = n_begin; n < n_end; ++n) pass_rows<Type, kTileRows>(p, n, t, rows);
  }
}

using ItemFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

struct TypeInfo {
  int64_t weights, bytes;
  bool mins;
  ItemFn item;
  const char* name;
};

template <class Type>
constexpr TypeInfo info_of(const char* name) {
  return {Type::kWeights, Type::kBytes, Type::kMins, &run_item<Type>, name};
}

// GGUF type ids (gguf.GGMLQuantizationType) -> kernel; kiln/gguf_blocks.py's GgmlType lists the same.
std::optional<TypeInfo> type_info(int64_t ggml_type) {
  switch (ggml_type) {
    case 2: return info_of<Q4_0>("Q4_0");
    case 6: return info_of<Q5_0>("Q5_0");
    case 7: return info_of<Q5_1>("Q5_1");
    case 8: return info_of<Q8_0>("Q8_0");
    case 12: return info_of<Q4_K>("Q4_K");
    case 13: return info_of<Q5_K>("Q5_K");
    case 14: return info_of<Q6_K>("Q6_K");
    default: return std::nullopt;
  }
}

void row_sums(const float* x, int64_t K, float* out) {
  for (int64_t s = 0; s < K / kSub; ++s, x += kSub) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
    const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
    out[s] = hsum(_mm256_add_ps(a, b));
  }
}

// y allocated as x's shape with N for K, after x [..., K] and bias [N] are checked (`w` names the weights in the
// errors).
float* checked_output(const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<float>* bias,
                      Ort::Custom::Tensor<float>& y, int64_t N, int64_t K, const std::string& w) {
  std::vector<int64_t> xs = x.Shape();
  if (xs.empty() || xs.back() != K)
    fail_gguf("x must be [..., K = " + std::to_string(K) + "] for " + w + ", got " + shape_text(xs));
  if (bias != nullptr && bias->Shape() != std::vector<int64_t>{N})
    fail_gguf("bias must be [N = " + std::to_string(N) + "], got " + shape_text(bias->Shape()));
  xs.back() = N;
  return y.Allocate(xs);
}

struct MatMulGGUF {
  MatMulGGUF(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info{info};
    ggml_type_ = kernel_info.GetAttribute<int64_t>("ggml_type");
    try {  // optional: absent in engines built before the int8 path, which keep float32 activations
      int8_activations_ = kernel_info.GetAttribute<int64_t>("int8_activations");
    } catch (const Ort::Exception&) {
      int8_activations_ = 0;
    }
    std::string name;
    const std::optional<WeightLayout> layout = read_weight_layout(kernel_info, name);
    if (!layout) fail_gguf("layout must be \"blocks\" or \"records\", got \"" + name + "\"");
    layout_ = *layout;
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& w,
                      std::optional<const Ort::Custom::Tensor<float>*> bias, Ort::Custom::Tensor<float>& y) {
    try {
      run(ctx, x, w, bias.value_or(nullptr), y);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.MatMulGGUF: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& w,
           const Ort::Custom::Tensor<float>* bias, Ort::Custom::Tensor<float>& y) const {
    const std::optional<TypeInfo> type = type_info(ggml_type_);
    if (!type)
      fail_gguf("ggml_type " + std::to_string(ggml_type_) +
                " has no kernel; supported: Q4_0 (2), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), "
                "Q6_K (14)");
    if (int8_activations_ != 0 && int8_activations_ != 1)
      fail_gguf("int8_activations must be 0 (float32 activations) or 1 (int8), got " +
                std::to_string(int8_activations_));
    if (int8_activations_ == 1 && (ggml_type_ == 6 || ggml_type_ == 7))
      fail_gguf(std::string("int8_activations = 1 has no kernel for ") + type->name +
                " (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K only); such a node keeps int8_activations = 0");
    if (layout_ == WeightLayout::kRecords) return run_records(ctx, x, w, bias, y);
    const std::vector<int64_t>& ws = w.Shape();
    if (ws.size() != 2 || ws[0] <= 0 || ws[1] <= 0 || ws[1] % type->bytes)
      fail_gguf(std::string("w must be uint8 [N, whole ") + type->name + " blocks of " + std::to_string(type->bytes) +
                " bytes], got " + shape_text(ws));
    const int64_t N = ws[0], row_bytes = ws[1], K = row_bytes / type->bytes * type->weights;
    float* out = checked_output(x, bias, y, N, K, std::string(type->name) + " w " + shape_text(ws));
    const int64_t T = x.NumberOfElement() / K;
    if (T == 0) return;

    const float* xd = x.Data();
    if (int8_activations_ == 1)
      return matmul_gguf_int8(ctx, ggml_type_, GgufMatmul{w.Data(), xd, bias ? bias->Data() : nullptr, out, T, N, K,
                                                          row_bytes});
    const std::vector<float> sums = gguf_float::row_sums_for(ggml_type_, xd, T, K);
    const Problem p{w.Data(), xd, sums.empty() ? nullptr : sums.data(), bias ? bias->Data() : nullptr, out, N, K,
                    row_bytes};
    const int64_t channel_chunks = (N + kChannelsPerItem - 1) / kChannelsPerItem;
    const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
    const ItemFn item_fn = type->item;
    auto item = [&](size_t i) {
      const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
      item_fn(p, c * kChannelsPerItem, std::min(N, (c + 1) * kChannelsPerItem), r * kRowsPerItem,
              std::min(T, (r + 1) * kRowsPerItem));
    };
    parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
  }

  // Q4_K / Q5_K / Q6_K / Q8_0 records (kiln/gguf_records.py): w [N / 16, K / 256, record bytes], kiln.MatMulQ4_1's tile on them.
  void run_records(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& w,
                   const Ort::Custom::Tensor<float>* bias, Ort::Custom::Tensor<float>& y) const {
    const int64_t record_bytes = gguf_records::record_bytes(ggml_type_);
    if (record_bytes == 0 || int8_activations_ != 1)
      fail_gguf("layout \"records\" is Q4_K's, Q5_K's, Q6_K's or Q8_0's (ggml_type 12, 13, 14, 8) with "
                "int8_activations = 1, got "
                "ggml_type " + std::to_string(ggml_type_) + " and int8_activations " +
                std::to_string(int8_activations_));
    const char* name = gguf_records::type_name(ggml_type_);
    const std::vector<int64_t>& ws = w.Shape();
    if (ws.size() != 3 || ws[0] <= 0 || ws[1] <= 0 || ws[2] != record_bytes)
      fail_gguf(std::string("w must be uint8 ") + name + " records [N / 16, K / 256, " + std::to_string(record_bytes) +
                "], got " + shape_text(ws));
    const int64_t N = ws[0] * q4_1::kGroup, K = ws[1] * gguf_records::kSuperBlock;
    float* out = checked_output(x, bias, y, N, K, std::string(name) + " records " + shape_text(ws));
    const int64_t T = x.NumberOfElement() / K;
    if (T == 0) return;
    gguf_records::multiply(ctx, ggml_type_, w.Data(), x.Data(), bias ? bias->Data() : nullptr, out, T, N, K);
  }

  int64_t ggml_type_ = -1;
  int64_t int8_activations_ = 0;
  WeightLayout layout_ = WeightLayout::kBlocks;
};

}  // namespace

namespace gguf_float {

bool block_type(int64_t ggml_type, GgufBlockType& out) {
  const std::optional<TypeInfo> type = type_info(ggml_type);
  if (type) out = {type->weights, type->bytes, type->name};
  return type.has_value();
}

std::vector<float> row_sums_for(int64_t ggml_type, const float* x, int64_t T, int64_t K) {
  std::vector<float> sums;
  if (!type_info(ggml_type)->mins) return sums;
  sums.resize(T * (K / kSub));
  for (int64_t t = 0; t < T; ++t) row_sums(x + t * K, K, sums.data() + t * (K / kSub));
  return sums;
}

void run_item(int64_t ggml_type, const GgufMatmul& m, const float* sums, int64_t n0, int64_t n1, int64_t t0,
              int64_t t1) {
  type_info(ggml_type)->item(Problem{m.w, m.x, sums, m.bias, m.y, m.N, m.K, m.row_bytes}, n0, n1, t0, t1);
}

}  // namespace gguf_float

void add_matmul_gguf(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MatMulGGUF>("MatMulGGUF", "CPUExecutionProvider"));
}

}  // namespace kiln
