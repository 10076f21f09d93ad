// kiln.MatMulGGUF: y = x @ W^T with W in a GGUF file's own blocks (spec: kiln/matmul_gguf.py).
#pragma once

#include <cstdint>
#include <vector>

#include "matmul_gguf_int8.h"
#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_matmul_gguf(Ort::CustomOpDomain& domain);

// The float32-activation path (int8_activations = 0), whose pieces kiln.MoE's GGUF experts also run per expert.
namespace gguf_float {

// A type this path decodes (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): its blocks into `out`; false otherwise.
bool block_type(int64_t ggml_type, GgufBlockType& out);

// The sums of each 32 consecutive values of x's T rows [T, K / 32] when the type's blocks have minimums (Q5_1,
// Q4_K, Q5_K), else empty.
std::vector<float> row_sums_for(int64_t ggml_type, const float* x, int64_t T, int64_t K);

// One work item: outputs m.y[t * m.N + n] for channels [n0, n1) and rows [t0, t1) of m.x [T, K]; sums from
// row_sums_for (of the same rows).
void run_item(int64_t ggml_type, const GgufMatmul& m, const float* sums, int64_t n0, int64_t n1, int64_t t0,
              int64_t t1);

}  // namespace gguf_float

}  // namespace kiln
