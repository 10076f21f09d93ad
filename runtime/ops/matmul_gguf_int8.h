// kiln.MatMulGGUF's int8-activation path (int8_activations = 1; spec: kiln/gguf_int8.py).
#pragma once

#include <cstdint>

#include "onnxruntime_lite_custom_op.h"

namespace kiln {

struct GgufMatmul {
  const uint8_t* w;   // [N, row_bytes]: the file's blocks
  const float* x;     // [T, K]
  const float* bias;  // [N] or nullptr
  float* y;           // [T, N]
  int64_t T, N, K, row_bytes;
};

// y = x @ W^T with x quantized per row to 8-bit blocks and integer block dots; ggml_type already validated.
void matmul_gguf_int8(OrtKernelContext* ctx, int64_t ggml_type, const GgufMatmul& m);

}  // namespace kiln
