// kiln.MoE: a sparse mixture-of-experts SwiGLU MLP (spec: kiln/moe.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_moe(Ort::CustomOpDomain& domain);

}  // namespace kiln
