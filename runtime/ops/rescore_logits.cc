// kiln.RescoreLogits (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract is written once, with its numpy reference implementation, in kiln/rescore_logits.py: the k
// largest logits of each row of a coarse head (ties towards the lower id) recomputed from an 8-bit table.
//
// Per row, without sorting or a heap over the vocabulary:
//   1. the maximum of each group of 64 logits;
//   2. tau, the k-th largest of those maxima: k groups reach it, so at least k logits do, and every logit of the
//      top k is >= tau; only the groups whose maximum reaches tau hold candidates (k groups unless maxima tie);
//   3. the candidates >= tau of those groups, cut to exactly k by nth_element on (value desc, id asc);
//   4. each chosen row of the table dotted with the hidden state, block by block (int8 minus zero point, in
//      float, scaled per block), written over the copied logits.
// A decode step's row (V = 49,152, k = 256, D = 576) measured ~0.15 ms on one core in the engine, most of it
// waiting for the 256 table rows (anywhere in 28 MB: cache and TLB misses; prefetching them 8 rows ahead did not
// help), against ~0.36 ms for the TopK, GatherBlockQuantized, MatMul and ScatterElements it replaces. Rows are
// independent, so they are spread over ONNX Runtime's intra-op pool, one row a task.
//
// Built with -O3 -mavx2 -mfma -mf16c (and once more with AVX-512 VNNI, where nothing here changes).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "rescore_logits.h"
#include "shape_text.h"
#include "simd.h"

namespace kiln {
namespace {

constexpr int64_t kGroup = 64;  // logits per group maximum
constexpr int64_t kBlock = 32;  // table entries per scale and zero point

[[noreturn]] void fail_rescore(const std::string& msg) {
  throw Ort::Exception("kiln.RescoreLogits: " + msg, ORT_INVALID_ARGUMENT);
}

// The maximum of x[0, n), n >= 1; NaN lanes never win (max_ps returns its second operand on NaN).
inline float group_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= 8) {
    __m256 m = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float v : lanes) best = std::max(best, v);
  }
  for (; i < n; ++i)
    if (x[i] > best) best = x[i];
  return best;
}

// Before: the greater value, or the lower id among equal values.
inline bool before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

struct Scratch {
  std::vector<float> maxima, order;
  std::vector<std::pair<float, int32_t>> candidates;
};

// The ids of row's k largest values (ties towards the lower id; a row with fewer non-NaN values gives them all).
void top_ids(const float* row, int64_t V, int64_t k, Scratch& s, std::vector<int32_t>& ids) {
  ids.clear();
  s.candidates.clear();
  const int64_t groups = (V + kGroup - 1) / kGroup;
  float tau = -std::numeric_limits<float>::infinity();
  if (k < groups) {
    s.maxima.resize(groups);
    for (int64_t g = 0; g < groups; ++g) s.maxima[g] = group_max(row + g * kGroup, std::min(kGroup, V - g * kGroup));
    s.order.assign(s.maxima.begin(), s.maxima.end());
    std::nth_element(s.order.begin(), s.order.begin() + (k - 1), s.order.end(), std::greater<float>());
    tau = s.order[k - 1];
    for (int64_t g = 0; g < groups; ++g) {
      if (!(s.maxima[g] >= tau)) continue;
      const int64_t end = std::min(V, (g + 1) * kGroup);
      for (int64_t i = g * kGroup; i < end; ++i)
        if (row[i] >= tau) s.candidates.emplace_back(row[i], static_cast<int32_t>(i));
    }
  } else {  // few groups: every non-NaN logit is a candidate
    for (int64_t i = 0; i < V; ++i)
      if (!std::isnan(row[i])) s.candidates.emplace_back(row[i], static_cast<int32_t>(i));
  }
  if (static_cast<int64_t>(s.candidates.size()) > k) {
    std::nth_element(s.candidates.begin(), s.candidates.begin() + (k - 1), s.candidates.end(), before);
    s.candidates.resize(k);
  }
  for (const auto& c : s.candidates) ids.push_back(c.second);
}

// sum_i (q[i] - zp[i / 32]) * scale[i / 32] * h[i] over D = 32 * blocks.
inline float dot_row(const uint8_t* q, const float* scale, const uint8_t* zp, const float* h, int64_t blocks) {
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, q += kBlock, h += kBlock) {
    const __m256i z = _mm256_set1_epi32(zp[b]);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < kBlock; i += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, z)), _mm256_loadu_ps(h + i), acc);
    }
    total = _mm256_fmadd_ps(acc, _mm256_set1_ps(scale[b]), total);
  }
  return hsum(total);
}

struct RescoreLogits {
  explicit RescoreLogits(const OrtApi*, const OrtKernelInfo* info) {
    k_ = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("k");
    if (k_ < 1) fail_rescore("attribute k must be >= 1, got " + std::to_string(k_));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& approx, const Ort::Custom::Tensor<float>& hidden,
                      const Ort::Custom::Tensor<uint8_t>& data, const Ort::Custom::Tensor<float>& scales,
                      const Ort::Custom::Tensor<uint8_t>& zero_points, Ort::Custom::Tensor<float>& logits) {
    try {
      run(ctx, approx, hidden, data, scales, zero_points, logits);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.RescoreLogits: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& approx, const Ort::Custom::Tensor<float>& hidden,
           const Ort::Custom::Tensor<uint8_t>& data, const Ort::Custom::Tensor<float>& scales,
           const Ort::Custom::Tensor<uint8_t>& zero_points, Ort::Custom::Tensor<float>& logits) const {
    const std::vector<int64_t>& ts = data.Shape();
    if (ts.size() != 2 || ts[0] <= 0 || ts[1] <= 0 || ts[1] % kBlock != 0)
      fail_rescore("data must be uint8 [V, D] with D a multiple of 32, got " + shape_text(ts));
    const int64_t V = ts[0], D = ts[1], blocks = D / kBlock;
    if (scales.Shape() != std::vector<int64_t>{V, blocks} || zero_points.Shape() != std::vector<int64_t>{V, blocks})
      fail_rescore("scales and zero_points must be [V, D / 32] = " + shape_text({V, blocks}) + ", got " +
                   shape_text(scales.Shape()) + " and " + shape_text(zero_points.Shape()));
    const std::vector<int64_t>& as = approx.Shape();
    std::vector<int64_t> hs = hidden.Shape();
    if (as.empty() || as.back() != V) fail_rescore("approx must be [..., V = " + std::to_string(V) + "], got " + shape_text(as));
    if (hs.empty() || hs.back() != D) fail_rescore("hidden must be [..., D = " + std::to_string(D) + "], got " + shape_text(hs));
    hs.back() = V;
    if (hs != as)
      fail_rescore("approx " + shape_text(as) + " and hidden " + shape_text(hidden.Shape()) +
                   " must share their leading dims");
    float* out = logits.Allocate(as);
    const int64_t rows = approx.NumberOfElement() / V;
    if (rows == 0) return;
    const uint8_t* q = data.Data();
    const float* s = scales.Data();
    const uint8_t* zp = zero_points.Data();
    auto rescore_row = [&](size_t item) {
      thread_local Scratch scratch;
      thread_local std::vector<int32_t> ids;
      const int64_t r = static_cast<int64_t>(item);
      const float* coarse = approx.Data() + r * V;
      const float* h = hidden.Data() + r * D;
      float* row = out + r * V;
      std::memcpy(row, coarse, static_cast<size_t>(V) * sizeof(float));
      top_ids(coarse, V, k_, scratch, ids);
      for (int32_t t : ids) row[t] = dot_row(q + t * D, s + t * blocks, zp + t * blocks, h, blocks);
    };
    parallel_for(ctx, static_cast<size_t>(rows), rescore_row);
  }

 private:
  int64_t k_ = 1;
};

}  // namespace

void add_rescore_logits(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<RescoreLogits>("RescoreLogits", "CPUExecutionProvider"));
}

}  // namespace kiln
