// kiln.SwiGLU: y = silu(x[..., :F]) * x[..., F:] (spec: kiln/swiglu.py).
#pragma once

#include <cstdint>

#include "onnxruntime_cxx_api.h"

namespace kiln {

// y[i] = silu(gate[i]) * up[i] for i < n, the op's arithmetic (kiln.MoE's experts apply it to their rows too).
void swiglu_values(const float* gate, const float* up, float* y, int64_t n);

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_swiglu(Ort::CustomOpDomain& domain);

}  // namespace kiln
