// kiln.SwiGLU (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract is written once, with its numpy reference implementation, in kiln/swiglu.py:
// y [..., F] = silu(x[..., :F]) * x[..., F:] for x float32 [..., 2F], silu(a) = a * sigmoid(a).
//
// One pass over each row: 8 lanes at a time, the row's tail through the same code with masked loads
// and stores (so every element gets the same arithmetic). sigmoid(a) is taken from e = exp(-|a|), which
// lies in (0, 1] and never overflows: a >= 0 gives 1 / (1 + e), a < 0 gives e / (1 + e). Rows run on
// ONNX Runtime's intra-op pool only when there are enough of them: a decode step's row (1536 elements for
// SmolLM2) takes about a microsecond, less than waking the pool costs.
//
// Built with -O3 -mavx2 -mfma -mf16c (AVX2 only).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "shape_text.h"
#include "simd.h"
#include "swiglu.h"

namespace kiln {
namespace {

// Output elements from which rows are spread over the thread pool, and per work item. The kernel takes
// ~0.7-1 ns per element on one core here (benchmarks/bench_swiglu.py, docs/design.md), so a 16-row decode
// step (~20 us) stays on the calling thread and an item of 32768 elements is ~25 us, well above a dispatch.
constexpr int64_t kParallelElements = 1 << 16;
constexpr int64_t kItemElements = 1 << 15;

// exp256 clamps its input at -87 (exp(-87) ~ 1.6e-38, float32's smallest normals); below it sigmoid(a) < 1e-38
// is taken as 0, else a * exp(-87) would leave silu(-3e38) at -4.9 instead of -0.
constexpr float kSigmoidZeroBelow = -87.f;

inline __m256 swiglu8(__m256 gate, __m256 up) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = exp256(_mm256_or_ps(gate, _mm256_set1_ps(-0.f)));  // exp(-|gate|) in (0, 1]
  const __m256 positive = _mm256_cmp_ps(gate, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 vanishing = _mm256_cmp_ps(gate, _mm256_set1_ps(kSigmoidZeroBelow), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_andnot_ps(
      vanishing, _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e)));
  return _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid), up);
}

// y[i] = silu(gate[i]) * up[i] for i < n, one row's pass (the header above says how).
void swiglu_values(const float* gate, const float* up, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    // lanes j < n - i on: the masked loads read nothing past the row, the masked store writes nothing past it
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane);
    _mm256_maskstore_ps(y + i, mask, swiglu8(_mm256_maskload_ps(gate + i, mask), _mm256_maskload_ps(up + i, mask)));
  }
}

}  // namespace

void swiglu_rows(OrtKernelContext* ctx, const float* gate, const float* up, int64_t ld, int64_t n_rows, int64_t F,
                 float* y) {
  if (n_rows < 2 || n_rows * F < kParallelElements) {
    for (int64_t r = 0; r < n_rows; ++r) swiglu_values(gate + r * ld, up + r * ld, y + r * F, F);
    return;
  }
  const int64_t per_item = std::max<int64_t>(1, kItemElements / F);
  auto item = [&](size_t i) {
    const int64_t end = std::min(n_rows, (static_cast<int64_t>(i) + 1) * per_item);
    for (int64_t r = static_cast<int64_t>(i) * per_item; r < end; ++r)
      swiglu_values(gate + r * ld, up + r * ld, y + r * F, F);
  };
  parallel_for(ctx, static_cast<size_t>((n_rows + per_item - 1) / per_item), item);
}

namespace {

struct SwiGLU {
  SwiGLU(const OrtApi*, const OrtKernelInfo*) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, Ort::Custom::Tensor<float>& y) {
    try {
      run(ctx, x, y);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.SwiGLU: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  static void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, Ort::Custom::Tensor<float>& y) {
    std::vector<int64_t> shape = x.Shape();
    if (shape.empty() || shape.back() % 2 != 0)
      throw Ort::Exception("kiln.SwiGLU: x must be [..., 2F] with an even last dimension, got " + shape_text(shape),
                           ORT_INVALID_ARGUMENT);
    const int64_t F = shape.back() / 2;
    shape.back() = F;
    float* out = y.Allocate(shape);
    if (F == 0) return;
    const int64_t rows = x.NumberOfElement() / (2 * F);
    if (rows == 0) return;
    swiglu_rows(ctx, x.Data(), x.Data() + F, 2 * F, rows, F, out);
  }
};

}  // namespace

void add_swiglu(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<SwiGLU>("SwiGLU", "CPUExecutionProvider"));
}

}  // namespace kiln
