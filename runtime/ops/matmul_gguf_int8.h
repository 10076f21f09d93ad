// kiln.MatMulGGUF's int8-activation path (int8_activations = 1; spec: kiln/gguf_int8.py), and its pieces that
// kiln.MoE's GGUF experts (moe_gguf.cc) run on each expert's rows: the activations' quantization and the work item.
#pragma once

#include <cstdint>
#include <vector>

#include "onnxruntime_lite_custom_op.h"

namespace kiln {

// A GGUF block type a kernel path decodes: a block's weights and bytes, and the type's name.
struct GgufBlockType {
  int64_t weights = 0, bytes = 0;
  const char* name = "";
};

struct GgufMatmul {
  const uint8_t* w;   // [N, row_bytes]: the file's blocks (row n at w + n * row_bytes)
  const float* x;     // [T, K]
  const float* bias;  // [N] or nullptr
  float* y;           // [T, N]
  int64_t T, N, K, row_bytes;
};

// y = x @ W^T with x quantized per row to 8-bit blocks and integer block dots; ggml_type already validated.
void matmul_gguf_int8(OrtKernelContext* ctx, int64_t ggml_type, const GgufMatmul& m);

namespace gguf_int8 {

constexpr int64_t kSumGroup = 16;  // activations per int sum (Q8_K's bsums)

// A type this path multiplies (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K: gguf.GGMLQuantizationType ids 2, 8, 12, 13, 14): its
// blocks into `out`; false for every other id.
bool block_type(int64_t ggml_type, GgufBlockType& out);

// What a weight type's blocks need of its activations: values per int8 step, the 16-sums of the codes (Q6_K), the
// float sums and their int8 errors per 32 (Q4_K, Q5_K).
struct Layout {
  int64_t block;
  bool sums, sub_sums;
};
Layout layout_of(int64_t ggml_type);

// Rows of activations quantized to int8 (the spec's float32 numbers).
struct Int8Rows {
  int64_t K = 0, block = 0;
  std::vector<int8_t> q;                  // [T, K]
  std::vector<float> step;                // [T, K / block]
  std::vector<int16_t> sums;              // [T, K / 16]: layouts with sums
  std::vector<float> sub_sum, sub_error;  // [T, K / 32]: layouts with sub_sums

  void reset(int64_t T, int64_t K_, const Layout& layout);
};

// out = rows[0..T) (each of length K) quantized for `layout`; rows in parallel where there are many values.
void quantize_rows(OrtKernelContext* ctx, const Layout& layout, const float* const* rows, int64_t T, int64_t K,
                   Int8Rows& out);

// One work item: outputs m.y[t * m.N + n] for channels [n0, n1) and rows [t0, t1) of `a` (m.x is not read; a
// holds the rows, quantized with a layout that has the type's block and sums).
void run_item(int64_t ggml_type, const GgufMatmul& m, const Int8Rows& a, int64_t n0, int64_t n1, int64_t t0,
              int64_t t1);

}  // namespace gguf_int8
}  // namespace kiln
