// kiln.MoE (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract is written once, with its numpy reference implementation, in kiln/moe.py: per token,
// softmax routing over E experts, the top_k chosen (renormalised when norm_topk_prob), and the weighted sum
// of the chosen experts' SwiGLU MLPs.
//
// The step runs in phases, each one parallel_for over independent work items:
//   1. router: logits [T, E] = x @ router^T, then per token the top_k experts and their weights;
//   2. the tokens are grouped by expert (a counting sort: expert e's tokens at rows [start_e, start_e + n_e) of
//      the grouped buffers);
//   3. gate/up + SwiGLU: an item is (expert, chunk of F's gate or of its up rows), which reads those rows once and
//      applies them to all of the expert's tokens (an expert's gate items, then its up items: the stack's order),
//      then act [T * top_k, F] = silu(gate) * up;
//   4. down: an item is (expert, chunk of D rows of down), out [T * top_k, D];
//   5. combine: y[t] = sum over t's slots of weight * out[row of (t, slot)], slots in routing order.
// So each selected expert's weights are read once per step whatever the number of its tokens, experts no token
// chose are never touched, and no two items write the same memory (each (token, slot) has its own row).
// Float32 experts run phases 3 and 4 here; Q4_1 experts run them with kiln.MatMulQ4_1's int8 arithmetic
// (moe_q4_1.cc) on its records: an engine's (layout "records") read where ONNX Runtime maps them, blocks (older
// engines) repacked once at session load when constant; GGUF experts with kiln.MatMulGGUF's int8 arithmetic on the
// file's blocks as they are (moe_gguf.cc).
//
// Built with -O3 -mavx2 -mfma -mf16c (AVX2 only).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <type_traits>
#include <vector>

#include "moe.h"
#include "moe_experts.h"
#include "parallel_for.h"
#include "shape_text.h"
#include "simd.h"
#include "weight_layout.h"

namespace kiln {
namespace {

using moe::Groups;
using moe::Item;
using moe::gate_then_up_items;
using moe::items_over;
using moe::ProjectionItem;

// Weight rows per work item: 32 gate or up rows (or 32 down rows) of D = 2048 floats are 256 KiB, ~10 us of
// DRAM bandwidth on two cores, well above an item's dispatch cost.
constexpr int64_t kGateRowsPerItem = 32;
constexpr int64_t kDownRowsPerItem = 32;
constexpr int64_t kRouterTokensPerItem = 16;
// router rows per item: a multiple of rows_dot_tokens' 4, so each logit is summed as in one call over all E
constexpr int64_t kRouterExpertsPerItem = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[t * ldo + (r - r0)] = xs[t] . W[r] for t < n, r in [r0, r1); W rows of length K. Four weight rows at a time
// against each token, so a weight row is loaded once per token group and a decode step (n = 1-2) streams W once.
void rows_dot_tokens(const float* W, int64_t r0, int64_t r1, int64_t K, const float* const* xs, int64_t n,
                     float* out, int64_t ldo) {
  const int64_t K8 = K & ~int64_t(7);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float* w = W + r * K;
    for (int64_t t = 0; t < n; ++t) {
      const float* x = xs[t];
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + K + k), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * K + k), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * K + k), a3);
      }
      float sums[4];
      _mm_storeu_ps(sums, hsum4(a0, a1, a2, a3));
      for (int i = 0; i < 4; ++i) {
        float s = sums[i];
        for (int64_t k = K8; k < K; ++k) s += x[k] * w[i * K + k];
        out[t * ldo + (r - r0) + i] = s;
      }
    }
  }
  for (; r < r1; ++r)
    for (int64_t t = 0; t < n; ++t) out[t * ldo + (r - r0)] = dot(xs[t], W + r * K, K);
}

struct Routing {
  std::vector<int32_t> expert;  // [T * top_k]: token t's slot j chose expert[t * top_k + j], best first
  std::vector<float> weight;    // [T * top_k]
};

// Token t's top_k experts by logit (= by softmax probability; equal logits: the lower index first) and weights.
// Every slot gets a valid expert even for NaN logits (a NaN never displaces a chosen expert, but fills an empty
// slot), so a bad row gives NaN output and never an out-of-range read.
void route_token(const float* logits, int64_t E, int64_t top_k, bool normalize, int32_t* expert, float* weight) {
  for (int64_t j = 0; j < top_k; ++j) expert[j] = -1;
  for (int64_t e = 0; e < E; ++e) {
    const float l = logits[e];
    int64_t j = top_k;  // the slot e takes: after every chosen expert with a logit >= l
    while (j > 0 && (expert[j - 1] < 0 || logits[expert[j - 1]] < l)) --j;
    if (j == top_k) continue;
    for (int64_t m = top_k - 1; m > j; --m) expert[m] = expert[m - 1];
    expert[j] = static_cast<int32_t>(e);
  }
  const float mx = logits[expert[0]];
  double total = 0.0;
  for (int64_t e = 0; e < E; ++e) total += std::exp(static_cast<double>(logits[e] - mx));
  double chosen = 0.0;
  for (int64_t j = 0; j < top_k; ++j) chosen += std::exp(static_cast<double>(logits[expert[j]] - mx));
  const double denom = normalize ? chosen : total;
  for (int64_t j = 0; j < top_k; ++j)
    weight[j] = static_cast<float>(std::exp(static_cast<double>(logits[expert[j]] - mx)) / denom);
}

Groups group_by_expert(const Routing& routing, int64_t E, int64_t top_k) {
  const int64_t rows = static_cast<int64_t>(routing.expert.size());
  Groups g{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(rows), std::vector<int64_t>(rows)};
  for (int32_t e : routing.expert) ++g.start[e + 1];
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < rows; ++i) {  // in token order within each expert
    const int64_t row = next[routing.expert[i]]++;
    g.token[row] = i / top_k;
    g.row_of[i] = row;
  }
  return g;
}

struct Dims {
  int64_t T, D, E, F, top_k;
};

[[noreturn]] void fail_moe(const std::string& what) { throw Ort::Exception("kiln.MoE: " + what, ORT_INVALID_ARGUMENT); }

// Shapes of x and router, and top_k: T, D, E and top_k (F is the experts' to give).
Dims check_routing(const std::vector<int64_t>& xs, const std::vector<int64_t>& rs, int64_t top_k) {
  if (xs.empty()) fail_moe("x must be [..., D], got a scalar");
  Dims d{1, xs.back(), 0, 0, top_k};
  for (size_t i = 0; i + 1 < xs.size(); ++i) d.T *= xs[i];
  if (rs.size() != 2 || rs[1] != d.D) fail_moe("router must be [E, D=" + std::to_string(d.D) + "], got " + shape_text(rs));
  d.E = rs[0];
  if (top_k < 1 || top_k > d.E) fail_moe("top_k must be in [1, E=" + std::to_string(d.E) + "], got " + std::to_string(top_k));
  return d;
}

// Shapes of x, router and the experts' stacks; `packed` divides the experts' last dim by 2 (Q4_1 nibbles).
Dims check_shapes(const std::vector<int64_t>& xs, const std::vector<int64_t>& rs, const std::vector<int64_t>& gus,
                  const std::vector<int64_t>& ds, int64_t top_k, bool packed) {
  Dims d = check_routing(xs, rs, top_k);
  const int64_t div = packed ? 2 : 1;
  const std::string last = packed ? "/2" : "";
  if (gus.size() != 3 || gus[0] != d.E || gus[2] * div != d.D || gus[1] % 2 != 0)
    fail_moe("gate_up must be [E=" + std::to_string(d.E) + ", 2F, D" + last + "=" + std::to_string(d.D / div) +
             "], got " + shape_text(gus));
  d.F = gus[1] / 2;
  if (ds.size() != 3 || ds[0] != d.E || ds[1] != d.D || ds[2] * div != d.F)
    fail_moe("down must be [E, D, F" + last + "] = " + shape_text({d.E, d.D, d.F / div}) + ", got " + shape_text(ds));
  if (packed && (d.D % 32 != 0 || d.F % 32 != 0))
    fail_moe("Q4_1 experts need D and F multiples of 32, got D=" + std::to_string(d.D) + ", F=" + std::to_string(d.F));
  return d;
}

// Phases 3 and 4 for float32 experts gate_up [E, 2F, D] and down [E, D, F]: expert_out [rows, D].
void run_float_experts(OrtKernelContext* ctx, const Dims& d, const Groups& g, const std::vector<const float*>& rows,
                       const float* gate_up, const float* down, float* expert_out) {
  const int64_t n_rows = static_cast<int64_t>(rows.size()), F2 = 2 * d.F;
  std::vector<float> hidden(n_rows * F2), act(n_rows * d.F);  // hidden: each row's gate, then its up
  const std::vector<ProjectionItem> gate_up_items = gate_then_up_items(g, d.F, kGateRowsPerItem);
  auto gate_up_item = [&](size_t i) {
    const Item& it = gate_up_items[i].item;
    const int64_t first = g.start[it.expert], n = g.start[it.expert + 1] - first;
    const int64_t r0 = (gate_up_items[i].up ? d.F : 0) + it.u0, r1 = r0 + it.u1 - it.u0;
    rows_dot_tokens(gate_up + it.expert * F2 * d.D, r0, r1, d.D, rows.data() + first, n,
                    hidden.data() + first * F2 + r0, F2);
  };
  parallel_for(ctx, gate_up_items.size(), gate_up_item);
  swiglu_rows(ctx, hidden.data(), hidden.data() + d.F, F2, n_rows, d.F, act.data());

  std::vector<const float*> act_rows(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) act_rows[i] = act.data() + i * d.F;
  const std::vector<Item> items = items_over(g, d.D, kDownRowsPerItem);
  auto down_item = [&](size_t i) {
    const Item& it = items[i];
    const int64_t first = g.start[it.expert], n = g.start[it.expert + 1] - first;
    rows_dot_tokens(down + it.expert * d.D * d.F, it.u0, it.u1, d.F, act_rows.data() + first, n,
                    expert_out + first * d.D + it.u0, d.D);
  };
  parallel_for(ctx, items.size(), down_item);
}

// The experts of one call: float32 stacks, Q4_1 ones as records (the session's, or packed for this call), or GGUF
// ones as the file's blocks.
struct Experts {
  const float* gate_up = nullptr;
  const float* down = nullptr;
  const moe::Q4_1Experts* q4_gate_up = nullptr;
  const moe::Q4_1Experts* q4_down = nullptr;
  float q4_1_centre = q4_1::kCentre;  // the Q4_1 experts' centre attribute
  std::optional<moe::GgufExperts> gguf;
};

// Phases 2-5 (see the file comment).
void moe_step(OrtKernelContext* ctx, const Dims& d, const float* in, const Routing& routing, const Experts& experts,
              float* out) {
  const Groups g = group_by_expert(routing, d.E, d.top_k);
  const int64_t rows = d.T * d.top_k;
  std::vector<const float*> token_rows(rows);
  for (int64_t i = 0; i < rows; ++i) token_rows[i] = in + g.token[i] * d.D;
  std::vector<float> expert_out(rows * d.D);
  if (experts.gguf.has_value())
    moe::run_gguf_experts(ctx, g, in, d.T, *experts.gguf, expert_out.data());
  else if (experts.q4_gate_up != nullptr)
    moe::run_q4_1_experts(ctx, g, token_rows, *experts.q4_gate_up, *experts.q4_down, experts.q4_1_centre,
                          expert_out.data());
  else
    run_float_experts(ctx, d, g, token_rows, experts.gate_up, experts.down, expert_out.data());

  auto combine = [&](size_t t) {
    float* dst = out + t * d.D;
    std::fill(dst, dst + d.D, 0.f);
    for (int64_t j = 0; j < d.top_k; ++j) {
      const int64_t slot = static_cast<int64_t>(t) * d.top_k + j;
      const float* src = expert_out.data() + g.row_of[slot] * d.D;
      const __m256 wv = _mm256_set1_ps(routing.weight[slot]);
      int64_t k = 0;
      for (; k + 8 <= d.D; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(wv, _mm256_loadu_ps(src + k), _mm256_loadu_ps(dst + k)));
      for (; k < d.D; ++k) dst[k] += routing.weight[slot] * src[k];
    }
  };
  parallel_for(ctx, static_cast<size_t>(d.T), combine);
}

Routing route(OrtKernelContext* ctx, const Dims& d, const float* x, const float* router, bool normalize) {
  // logits [T, E] in items of (16 tokens, 16 experts): a decode step's router, E x D float32 read from memory, is
  // split across the threads like the experts after it (alone on one thread it was ~3% of an OLMoE layer's MoE)
  std::vector<float> logits(d.T * d.E);
  const int64_t token_chunks = (d.T + kRouterTokensPerItem - 1) / kRouterTokensPerItem;
  const int64_t expert_chunks = (d.E + kRouterExpertsPerItem - 1) / kRouterExpertsPerItem;
  auto logits_item = [&](size_t i) {
    const int64_t t0 = static_cast<int64_t>(i) / expert_chunks * kRouterTokensPerItem;
    const int64_t e0 = static_cast<int64_t>(i) % expert_chunks * kRouterExpertsPerItem;
    const int64_t n = std::min(d.T, t0 + kRouterTokensPerItem) - t0;
    std::vector<const float*> xs(n);
    for (int64_t t = 0; t < n; ++t) xs[t] = x + (t0 + t) * d.D;
    rows_dot_tokens(router, e0, std::min(d.E, e0 + kRouterExpertsPerItem), d.D, xs.data(), n,
                    logits.data() + t0 * d.E + e0, d.E);
  };
  parallel_for(ctx, static_cast<size_t>(token_chunks * expert_chunks), logits_item);

  Routing r{std::vector<int32_t>(d.T * d.top_k), std::vector<float>(d.T * d.top_k)};
  auto route_chunk = [&](size_t c) {
    const int64_t t1 = std::min(d.T, (static_cast<int64_t>(c) + 1) * kRouterTokensPerItem);
    for (int64_t t = static_cast<int64_t>(c) * kRouterTokensPerItem; t < t1; ++t)
      route_token(logits.data() + t * d.E, d.E, d.top_k, normalize, r.expert.data() + t * d.top_k,
                  r.weight.data() + t * d.top_k);
  };
  parallel_for(ctx, static_cast<size_t>(token_chunks), route_chunk);
  return r;
}

using DmInput = std::optional<const Ort::Custom::Tensor<Ort::Float16_t>*>;

// The Q4_1 experts' layout (kiln/moe.py): the attribute, absent in engines of op-library ABI < 11 (blocks).
using Layout = WeightLayout;

Layout read_layout(const Ort::ConstKernelInfo& info) {
  std::string name;
  if (const std::optional<Layout> layout = read_weight_layout(info, name)) return *layout;
  fail_moe("layout must be \"blocks\" or \"records\", got \"" + name + "\"");
}

// Shapes of x, router and Q4_1 experts in the records layout: gate_up [E, 2F / 16, D / 32, 320], down
// [E, D / 16, F / 32, 320], each dm float16 [E, rows, 0] (no numbers: its shape names the rows).
Dims check_records_shapes(const std::vector<int64_t>& xs, const std::vector<int64_t>& rs,
                          const std::vector<int64_t>& gus, const std::vector<int64_t>& ds, DmInput gate_up_dm,
                          DmInput down_dm, int64_t top_k) {
  using q4_1::kBlock;
  using q4_1::kGroup;
  using q4_1::kRecordBytes;
  Dims d = check_routing(xs, rs, top_k);
  if (d.D % kBlock != 0) fail_moe("Q4_1 experts need D a multiple of 32, got D=" + std::to_string(d.D));
  const std::string records = std::to_string(kRecordBytes);
  if (gus.size() != 4 || gus[0] != d.E || gus[1] <= 0 || (gus[1] * kGroup) % (2 * kBlock) != 0 ||
      gus[2] != d.D / kBlock || gus[3] != kRecordBytes)
    fail_moe("gate_up must be uint8 records [E=" + std::to_string(d.E) + ", 2F/16 (F a multiple of 32), D/32=" +
             std::to_string(d.D / kBlock) + ", " + records + "] with layout \"records\", got " + shape_text(gus));
  d.F = gus[1] * kGroup / 2;
  const std::vector<int64_t> want_down{d.E, d.D / kGroup, d.F / kBlock, kRecordBytes};
  if (ds != want_down)
    fail_moe("down must be uint8 records [E, D/16, F/32, " + records + "] = " + shape_text(want_down) +
             " with layout \"records\", got " + shape_text(ds));
  const std::pair<DmInput, std::vector<int64_t>> dms[2] = {{gate_up_dm, {d.E, 2 * d.F, 0}}, {down_dm, {d.E, d.D, 0}}};
  const char* const names[2] = {"gate_up_dm", "down_dm"};
  for (int i = 0; i < 2; ++i)
    if (!dms[i].first.has_value() || (*dms[i].first)->Shape() != dms[i].second)
      fail_moe(std::string(names[i]) + " must be float16 " + shape_text(dms[i].second) +
               " with layout \"records\" (no numbers: its shape names the rows), got " +
               (dms[i].first.has_value() ? shape_text((*dms[i].first)->Shape()) : std::string("none")));
  return d;
}

// A Q4_1 stack's dm [E, rows, K / 32, 2] checked against its nibbles; its float16 bits.
const uint16_t* checked_dm(DmInput dm, const std::vector<int64_t>& w, int64_t rows, int64_t K, const std::string& name) {
  if (!dm.has_value()) fail_moe("Q4_1 " + name + " needs its " + name + "_dm input");
  const std::vector<int64_t> want{w[0], rows, K / 32, 2};
  if ((*dm)->Shape() != want) fail_moe(name + "_dm must be " + shape_text(want) + ", got " + shape_text((*dm)->Shape()));
  return reinterpret_cast<const uint16_t*>((*dm)->Data());
}

// Constant Q4_1 experts (an engine's: initializers) packed into records once, at session load; empty otherwise or
// when a shape is off (Compute then packs per call, or names the problem).
void pack_constant_experts(const Ort::ConstKernelInfo& info, moe::Q4_1Experts& gate_up, moe::Q4_1Experts& down) {
  if (info.GetInputCount() < 6) return;
  int constant[4] = {0, 0, 0, 0};
  std::vector<Ort::ConstValue> v;
  for (int i = 0; i < 4; ++i) v.push_back(info.GetTensorConstantInput(2 + i, &constant[i]));
  for (int c : constant)
    if (!c) return;
  std::vector<std::vector<int64_t>> s;
  for (const auto& value : v) s.push_back(value.GetTensorTypeAndShapeInfo().GetShape());
  if (s[0].size() != 3 || s[1].size() != 3) return;
  const int64_t E = s[0][0], D = s[0][2] * 2, F = s[1][2] * 2;
  if (D % 32 || F % 32 || s[0][1] != 2 * F || s[1] != std::vector<int64_t>{E, D, F / 2} ||
      s[2] != std::vector<int64_t>{E, 2 * F, D / 32, 2} || s[3] != std::vector<int64_t>{E, D, F / 32, 2} ||
      v[0].GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ||
      v[1].GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ||
      v[2].GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
      v[3].GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    return;
  auto steps = [&](int i) { return reinterpret_cast<const uint16_t*>(v[i].GetTensorData<Ort::Float16_t>()); };
  gate_up = moe::Q4_1Experts::pack(v[0].GetTensorData<uint8_t>(), steps(2), E, 2 * F, D);
  down = moe::Q4_1Experts::pack(v[1].GetTensorData<uint8_t>(), steps(3), E, D, F);
  // once repacked the engine's mapped bytes are never read again (kiln.MatMulQ4_1 does the same)
  for (int i = 0; i < 2; ++i) q4_1::release_pages(v[i].GetTensorData<uint8_t>(), v[i].GetTensorTypeAndShapeInfo().GetElementCount());
  for (int i = 2; i < 4; ++i) q4_1::release_pages(steps(i), v[i].GetTensorTypeAndShapeInfo().GetElementCount() * 2);
}

// The node's GGUF expert types (gate_type, up_type, down_type): all three, or none (Q4_1 experts).
bool gguf_types(const Ort::ConstKernelInfo& info, int64_t types[3]) {
  static const char* const kNames[3] = {"gate_type", "up_type", "down_type"};
  int found = 0;
  for (int i = 0; i < 3; ++i) {
    try {
      types[i] = info.GetAttribute<int64_t>(kNames[i]);
      ++found;
    } catch (const Ort::Exception&) {
    }
  }
  if (found != 0 && found != 3) fail_moe("GGUF experts need all of gate_type, up_type and down_type");
  return found == 3;
}

// GGUF experts' activation path: int8_activations 1 (absent: the `gguf` scheme's) or 0 (float32).
bool gguf_int8_activations(const Ort::ConstKernelInfo& info) {
  int64_t value = 1;
  try {
    value = info.GetAttribute<int64_t>("int8_activations");
  } catch (const Ort::Exception&) {
  }
  if (value != 0 && value != 1)
    fail_moe("int8_activations must be 0 (float32 activations) or 1 (int8), got " + std::to_string(value));
  return value == 1;
}

// W = float: float32 experts (no dm inputs); W = uint8_t: Q4_1 experts with their dm inputs, or GGUF experts (the
// gate_type, up_type and down_type attributes, int8_activations optional; no dm inputs).
template <typename W>
struct MoE {
  static constexpr bool kQ4 = std::is_same<W, uint8_t>::value;

  // Records are read in place on every call. Constant blocks (older engines) are packed once, here; others on every
  // call.
  MoE(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    top_k_ = ki.GetAttribute<int64_t>("top_k");
    norm_topk_prob_ = ki.GetAttribute<int64_t>("norm_topk_prob") != 0;
    layout_ = read_layout(ki);
    centre_ = read_centre(ki, q4_1::kCentre, fail_moe);
    if constexpr (kQ4) {
      gguf_ = gguf_types(ki, gguf_types_);
      if (gguf_ && centre_ != q4_1::kCentre) fail_moe("centre is for Q4_1 experts, not GGUF ones (their types say it)");
      if (gguf_) {
        gguf_int8_ = gguf_int8_activations(ki);
        if (layout_ == Layout::kRecords && !gguf_int8_)
          fail_moe("layout \"records\" holds GGUF experts for int8 activations; this node has int8_activations = 0");
      } else if (layout_ == Layout::kBlocks) {
        pack_constant_experts(ki, gate_up_, down_);
      }
    } else if (layout_ == Layout::kRecords) {
      fail_moe("layout \"records\" is for Q4_1 experts (uint8), not float32 ones");
    } else if (centre_ != q4_1::kCentre) {
      fail_moe("centre is for Q4_1 experts (uint8), not float32 ones");
    }
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<float>& router,
                      const Ort::Custom::Tensor<W>& gate_up, const Ort::Custom::Tensor<W>& down, DmInput gate_up_dm,
                      DmInput down_dm, Ort::Custom::Tensor<float>& y) {
    try {
      Dims d;
      Experts experts;
      moe::Q4_1Experts call_gate_up, call_down;  // records read in place, or non-constant blocks packed for this call
      if constexpr (kQ4) {
        if (gguf_) {
          if (gate_up_dm.has_value() || down_dm.has_value()) fail_moe("GGUF experts take no gate_up_dm or down_dm input");
          d = check_routing(x.Shape(), router.Shape(), top_k_);
          if (gate_up.Shape().empty() || gate_up.Shape()[0] != d.E)
            fail_moe("gate_up must be [E=" + std::to_string(d.E) + ", 2F, row bytes], got " + shape_text(gate_up.Shape()));
          if (layout_ == Layout::kRecords) {
            experts.gguf = moe::checked_gguf_expert_records(gguf_types_, gate_up.Data(), gate_up.Shape(), down.Data(),
                                                            down.Shape(), d.D);
            d.F = experts.gguf->gate.rows;
          } else {
            experts.gguf = moe::checked_gguf_experts(gguf_types_, gguf_int8_, gate_up.Data(), gate_up.Shape(),
                                                     down.Data(), down.Shape(), d.D);
            d.F = gate_up.Shape()[1] / 2;
          }
        } else if (layout_ == Layout::kRecords) {
          d = check_records_shapes(x.Shape(), router.Shape(), gate_up.Shape(), down.Shape(), gate_up_dm, down_dm,
                                   top_k_);
          call_gate_up = moe::Q4_1Experts::view(gate_up.Data(), 2 * d.F, d.D);
          call_down = moe::Q4_1Experts::view(down.Data(), d.D, d.F);
          experts.q4_gate_up = &call_gate_up;
          experts.q4_down = &call_down;
        } else {
          d = check_shapes(x.Shape(), router.Shape(), gate_up.Shape(), down.Shape(), top_k_, true);
          const uint16_t* gu_dm = checked_dm(gate_up_dm, gate_up.Shape(), 2 * d.F, d.D, "gate_up");
          const uint16_t* dn_dm = checked_dm(down_dm, down.Shape(), d.D, d.F, "down");
          if (gate_up_.empty()) {
            call_gate_up = moe::Q4_1Experts::pack(gate_up.Data(), gu_dm, d.E, 2 * d.F, d.D);
            call_down = moe::Q4_1Experts::pack(down.Data(), dn_dm, d.E, d.D, d.F);
          }
          experts.q4_gate_up = gate_up_.empty() ? &call_gate_up : &gate_up_;
          experts.q4_down = down_.empty() ? &call_down : &down_;
        }
      } else {
        d = check_shapes(x.Shape(), router.Shape(), gate_up.Shape(), down.Shape(), top_k_, false);
        if (gate_up_dm.has_value() || down_dm.has_value()) fail_moe("float32 experts take no gate_up_dm or down_dm input");
        experts.gate_up = gate_up.Data();
        experts.down = down.Data();
      }
      experts.q4_1_centre = centre_;
      float* out = y.Allocate(x.Shape());
      if (d.T == 0 || d.D == 0) return Ort::Status{nullptr};
      const Routing routing = route(ctx, d, x.Data(), router.Data(), norm_topk_prob_);
      moe_step(ctx, d, x.Data(), routing, experts, out);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.MoE: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

 private:
  int64_t top_k_ = 1;
  bool norm_topk_prob_ = false;
  Layout layout_ = Layout::kBlocks;
  float centre_ = q4_1::kCentre;  // Q4_1 experts' (kiln/moe.py)
  bool gguf_ = false, gguf_int8_ = true;
  int64_t gguf_types_[3] = {0, 0, 0};
  moe::Q4_1Experts gate_up_, down_;  // constant Q4_1 blocks packed into records; empty: records read in place, or
                                     // blocks packed per call
};

}  // namespace

void add_moe(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MoE<float>>("MoE", "CPUExecutionProvider"));
  domain.Add(Ort::Custom::CreateLiteCustomOp<MoE<uint8_t>>("MoE", "CPUExecutionProvider"));
}

}  // namespace kiln
