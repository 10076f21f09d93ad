// kiln.SwiGLU: y = silu(x[..., :F]) * x[..., F:] (spec: kiln/swiglu.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_swiglu(Ort::CustomOpDomain& domain);

}  // namespace kiln
