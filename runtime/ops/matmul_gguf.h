// kiln.MatMulGGUF: y = x @ W^T with W in a GGUF file's own blocks (spec: kiln/matmul_gguf.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_matmul_gguf(Ort::CustomOpDomain& domain);

}  // namespace kiln
