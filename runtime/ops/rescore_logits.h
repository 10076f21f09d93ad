// kiln.RescoreLogits: the k largest logits of each row recomputed from an 8-bit table (spec: kiln/rescore_logits.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_rescore_logits(Ort::CustomOpDomain& domain);

}  // namespace kiln
