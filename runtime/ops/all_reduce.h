// kiln.AllReduce: the sum of every tensor-parallel rank's x through a shared-memory workspace (spec: kiln/all_reduce.py).
#pragma once

#include "onnxruntime_cxx_api.h"

namespace kiln {

// Adds the op's CPU kernel to the "kiln" domain (called once from RegisterCustomOps).
void add_all_reduce(Ort::CustomOpDomain& domain);

}  // namespace kiln
