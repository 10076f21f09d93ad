// kiln.MatMulQ4_1: y = x @ W^T with W in llama.cpp's Q4_1 blocks (spec: kiln/matmul_q4_1.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_matmul_q4_1(Ort::CustomOpDomain& domain);

}  // namespace kiln
