// kiln.SwiGLU: y = silu(x[..., :F]) * x[..., F:] (spec: kiln/swiglu.py).
#pragma once

#include <cstdint>

#include "onnxruntime_cxx_api.h"

namespace kiln {

// y [n_rows, F] = silu(gate) * up with the op's arithmetic, row r's gate and up at gate + r * ld and up + r * ld
// (the op: one [rows, 2F] input, ld 2F); rows spread over ONNX Runtime's intra-op pool when there are enough values.
// kiln.MoE's experts apply it to their grouped rows too.
void swiglu_rows(OrtKernelContext* ctx, const float* gate, const float* up, int64_t ld, int64_t n_rows, int64_t F,
                 float* y);

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_swiglu(Ort::CustomOpDomain& domain);

}  // namespace kiln
