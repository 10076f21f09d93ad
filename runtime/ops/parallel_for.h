// f(0), ..., f(n - 1) on ONNX Runtime's intra-op thread pool (the session's threads), the calling thread included.
#pragma once

#include <cstddef>

#include "onnxruntime_lite_custom_op.h"

namespace kiln {

template <typename F>
void parallel_for(OrtKernelContext* ctx, size_t n, F& f) {
  if (n == 0) return;
  if (n == 1) return f(0);
  Ort::KernelContext(ctx).ParallelFor([](void* fn, size_t i) { (*static_cast<F*>(fn))(i); }, n, 0, &f);
}

}  // namespace kiln
