// The weight attributes of the quantized ops: "layout", whose weights come either as blocks or as records, the
// kernels' own layout (kiln.MatMulQ4_1 and kiln.MoE's Q4_1 experts: kiln/matmul_q4_1.py, kiln/moe.py;
// kiln.MatMulGGUF's Q4_K: kiln/gguf_records.py), and the Q4_1 weights' "centre".
#pragma once

#include <cmath>
#include <optional>
#include <string>

#include "onnxruntime_lite_custom_op.h"

namespace kiln {

enum class WeightLayout { kBlocks, kRecords };

// The node's layout: blocks where the attribute is absent (engines written before the op had records); nullopt
// for any other name, which is then left in `name` for the op's own error.
inline std::optional<WeightLayout> read_weight_layout(const Ort::ConstKernelInfo& info, std::string& name) {
  try {
    name = info.GetAttribute<std::string>("layout");
  } catch (const Ort::Exception&) {
    return WeightLayout::kBlocks;
  }
  if (name == "blocks") return WeightLayout::kBlocks;
  if (name == "records") return WeightLayout::kRecords;
  return std::nullopt;
}

// The "centre" attribute of Q4_1 weights (kiln.MatMulQ4_1, kiln.MoE's Q4_1 experts): the code c whose product with a
// block's int8 rounding error the kernels take from the exact block sum (the spec's c * d * E); absent: `fallback`,
// the nibbles' mean. A value outside [0, 15] (or not finite) goes to `fail` (the op's, which names it) with the
// problem.
template <class Fail>
float read_centre(const Ort::ConstKernelInfo& info, float fallback, Fail&& fail) {
  float value = fallback;
  try {
    value = info.GetAttribute<float>("centre");
  } catch (const Ort::Exception&) {
    return fallback;
  }
  if (!std::isfinite(value) || value < 0.f || value > 15.f)
    fail("centre must be a code in [0, 15] (7.5 the nibbles' mean, 8 for Q4_0 blocks), got " + std::to_string(value));
  return value;
}

}  // namespace kiln
