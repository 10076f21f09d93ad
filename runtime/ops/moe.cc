// kiln.MoE (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract is written once, with its numpy reference implementation, in kiln/moe.py: per token,
// softmax routing over E experts, the top_k chosen (renormalised when norm_topk_prob), and the weighted sum
// of the chosen experts' SwiGLU MLPs.
//
// The step runs in four phases, each one parallel_for over independent work items:
//   1. router: logits [T, E] = x @ router^T, then per token the top_k experts and their weights;
//   2. the tokens are grouped by expert (a counting sort: expert e's tokens at rows [start_e, start_e + n_e) of
//      the grouped buffers);
//   3. gate/up + SwiGLU: an item is (expert, chunk of F), which reads its gate and up rows once and applies them to
//      all of the expert's tokens, writing act [T * top_k, F];
//   4. down: an item is (expert, chunk of D rows of down), out [T * top_k, D];
//   5. combine: y[t] = sum over t's slots of weight * out[row of (t, slot)], slots in routing order.
// So each selected expert's weights are read once per step whatever the number of its tokens, experts no token
// chose are never touched, and no two items write the same memory (each (token, slot) has its own row).
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
#include <type_traits>
#include <vector>

#include "moe.h"
#include "parallel_for.h"
#include "shape_text.h"
#include "simd.h"

namespace kiln {
namespace {

// Weight rows per work item: 16 gate + 16 up rows (or 32 down rows) of D = 2048 floats are 256 KiB, ~10 us of
// DRAM bandwidth on two cores, well above an item's dispatch cost.
constexpr int64_t kGateRowsPerItem = 16;
constexpr int64_t kDownRowsPerItem = 32;
constexpr int64_t kRouterTokensPerItem = 16;

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

// Expert weights in Q4_1's numbers (kiln/moe.py): per block of 32 inputs, w = m + q * d, q a nibble. A row's 16 bytes a
// block hold element j in byte j's low nibble and element j + 16 in its high one (a GGUF block_q4_1's qs);
// dm holds the blocks' (d, m) float16 pairs. x . w = sum_b d * (x_b . q_b) + m * sum(x_b), with each token's block
// sums computed once per phase (xsum), so a block costs one unpack and four FMAs per token.
struct Q4Rows {
  const uint8_t* q;        // [rows, K / 2]
  const uint16_t* dm;      // [rows, K / 32, 2] float16 bits
  int64_t K;
};

inline __m256 nibbles_to_ps(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }

// Row r of w against NT tokens: each block's nibbles are unpacked to floats once and used for all NT tokens.
template <int NT>
inline void dot_q4_tile(const Q4Rows& w, int64_t r, const float* const* xs, const float* const* xsums, float* out,
                        int64_t ldo) {
  const int64_t nb = w.K / 32;
  const uint8_t* q = w.q + r * (w.K / 2);
  const uint16_t* dm = w.dm + r * nb * 2;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[NT];
  float mins[NT];
  for (int j = 0; j < NT; ++j) {
    acc[j] = _mm256_setzero_ps();
    mins[j] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m256 q0 = nibbles_to_ps(lo), q1 = nibbles_to_ps(_mm_srli_si128(lo, 8));
    const __m256 q2 = nibbles_to_ps(hi), q3 = nibbles_to_ps(_mm_srli_si128(hi, 8));
    const __m256 step = _mm256_set1_ps(_cvtsh_ss(dm[2 * b]));
    const float minimum = _cvtsh_ss(dm[2 * b + 1]);
    for (int j = 0; j < NT; ++j) {
      const float* xb = xs[j] + b * 32;
      __m256 block = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
      block = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q1, block);
      block = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, block);
      block = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, block);
      acc[j] = _mm256_fmadd_ps(step, block, acc[j]);
      mins[j] = std::fma(minimum, xsums[j][b], mins[j]);  // explicit: the same rounding in every tile size
    }
  }
  for (int j = 0; j < NT; ++j) out[j * ldo] = hsum(acc[j]) + mins[j];
}

// out[t * ldo + (r - r0)] = xs[t] . W[r] for Q4_1 rows, xsums[t] the token's block sums; four tokens a tile. A
// token's result is the same arithmetic in every tile size, so it does not depend on the batch.
void q4_rows_dot_tokens(const Q4Rows& w, int64_t r0, int64_t r1, const float* const* xs, const float* const* xsums,
                        int64_t n, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; ++r) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) dot_q4_tile<4>(w, r, xs + t, xsums + t, out + t * ldo + (r - r0), ldo);
    for (; t < n; ++t) dot_q4_tile<1>(w, r, xs + t, xsums + t, out + t * ldo + (r - r0), ldo);
  }
}

// Block sums [rows, K / 32] of rows xs[i] (length K).
std::vector<float> block_sums(const std::vector<const float*>& xs, int64_t K) {
  const int64_t nb = K / 32;
  std::vector<float> sums(xs.size() * nb);
  for (size_t i = 0; i < xs.size(); ++i)
    for (int64_t b = 0; b < nb; ++b) {
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xs[i] + b * 32), _mm256_loadu_ps(xs[i] + b * 32 + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xs[i] + b * 32 + 16), _mm256_loadu_ps(xs[i] + b * 32 + 24)));
      sums[i * nb + b] = hsum(s);
    }
  return sums;
}

inline float silu_times(float gate, float up) {
  // sigmoid from exp(-|gate|) <= 1: no overflow for any finite gate
  const float e = std::exp(-std::fabs(gate));
  const float sigmoid = gate >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return gate * sigmoid * up;
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

struct Groups {
  std::vector<int64_t> start;   // [E + 1]: expert e's rows of the grouped buffers are [start[e], start[e + 1])
  std::vector<int64_t> token;   // [T * top_k]: the token of each grouped row
  std::vector<int64_t> row_of;  // [T * top_k]: the grouped row of (token t, slot j) at t * top_k + j
};

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

// A work item: expert e's weight rows [r0, r1) (of F for gate/up, of D for down).
struct Item {
  int64_t expert, r0, r1;
};

std::vector<Item> items_over(const Groups& g, int64_t E, int64_t rows, int64_t per_item) {
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    if (g.start[e + 1] > g.start[e])
      for (int64_t r = 0; r < rows; r += per_item) items.push_back({e, r, std::min(rows, r + per_item)});
  return items;
}

struct Dims {
  int64_t T, D, E, F, top_k;
};

[[noreturn]] void fail_moe(const std::string& what) { throw Ort::Exception("kiln.MoE: " + what, ORT_INVALID_ARGUMENT); }

// Shapes of x, router and the experts' stacks; `packed` divides the experts' last dim by 2 (Q4_1 nibbles).
Dims check_shapes(const std::vector<int64_t>& xs, const std::vector<int64_t>& rs, const std::vector<int64_t>& gus,
                  const std::vector<int64_t>& ds, int64_t top_k, bool packed) {
  if (xs.empty()) fail_moe("x must be [..., D], got a scalar");
  Dims d{1, xs.back(), 0, 0, top_k};
  for (size_t i = 0; i + 1 < xs.size(); ++i) d.T *= xs[i];
  if (rs.size() != 2 || rs[1] != d.D) fail_moe("router must be [E, D=" + std::to_string(d.D) + "], got " + shape_text(rs));
  d.E = rs[0];
  const int64_t div = packed ? 2 : 1;
  const std::string last = packed ? "/2" : "";
  if (gus.size() != 3 || gus[0] != d.E || gus[2] * div != d.D || gus[1] % 2 != 0)
    fail_moe("gate_up must be [E=" + std::to_string(d.E) + ", 2F, D" + last + "=" + std::to_string(d.D / div) +
             "], got " + shape_text(gus));
  d.F = gus[1] / 2;
  if (ds.size() != 3 || ds[0] != d.E || ds[1] != d.D || ds[2] * div != d.F)
    fail_moe("down must be [E, D, F" + last + "] = " + shape_text({d.E, d.D, d.F / div}) + ", got " + shape_text(ds));
  if (top_k < 1 || top_k > d.E) fail_moe("top_k must be in [1, E=" + std::to_string(d.E) + "], got " + std::to_string(top_k));
  if (packed && (d.D % 32 != 0 || d.F % 32 != 0))
    fail_moe("Q4_1 experts need D and F multiples of 32, got D=" + std::to_string(d.D) + ", F=" + std::to_string(d.F));
  return d;
}

// One projection's expert stack [E, rows, K]: float32 rows, or Q4_1 nibbles + (d, m) pairs.
struct ExpertStack {
  const float* f = nullptr;
  const uint8_t* q = nullptr;
  const uint16_t* dm = nullptr;
  int64_t rows = 0, K = 0;

  void dot(int64_t e, int64_t r0, int64_t r1, const float* const* xs, const float* const* xsums, int64_t n,
           float* out, int64_t ldo) const {
    if (f != nullptr) return rows_dot_tokens(f + e * rows * K, r0, r1, K, xs, n, out, ldo);
    const Q4Rows w{q + e * rows * (K / 2), dm + e * rows * (K / 32) * 2, K};
    q4_rows_dot_tokens(w, r0, r1, xs, xsums, n, out, ldo);
  }
};

// The step (see the file comment) for float or Q4_1 experts.
void moe_step(OrtKernelContext* ctx, const Dims& d, const float* in, const Routing& routing, const ExpertStack& gate_up,
              const ExpertStack& down, float* out) {
  const bool q4 = gate_up.f == nullptr;
  const Groups g = group_by_expert(routing, d.E, d.top_k);
  const int64_t rows = d.T * d.top_k;
  std::vector<const float*> token_rows(rows);
  for (int64_t i = 0; i < rows; ++i) token_rows[i] = in + g.token[i] * d.D;
  // Q4_1: each grouped row's block sums (a token's once per slot: cheap next to the expert's rows)
  const std::vector<float> x_sums = q4 ? block_sums(token_rows, d.D) : std::vector<float>();
  std::vector<const float*> x_sum_rows(rows, nullptr);
  if (q4) for (int64_t i = 0; i < rows; ++i) x_sum_rows[i] = x_sums.data() + i * (d.D / 32);

  std::vector<float> act(rows * d.F);
  std::vector<Item> items = items_over(g, d.E, d.F, kGateRowsPerItem);
  auto gate_up_item = [&](size_t i) {
    const Item& it = items[i];
    const int64_t first = g.start[it.expert], n = g.start[it.expert + 1] - first, w = it.r1 - it.r0;
    std::vector<float> gate(n * w), up(n * w);
    gate_up.dot(it.expert, it.r0, it.r1, token_rows.data() + first, x_sum_rows.data() + first, n, gate.data(), w);
    gate_up.dot(it.expert, d.F + it.r0, d.F + it.r1, token_rows.data() + first, x_sum_rows.data() + first, n,
                up.data(), w);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < w; ++j) act[(first + t) * d.F + it.r0 + j] = silu_times(gate[t * w + j], up[t * w + j]);
  };
  parallel_for(ctx, items.size(), gate_up_item);

  std::vector<const float*> act_rows(rows);
  for (int64_t i = 0; i < rows; ++i) act_rows[i] = act.data() + i * d.F;
  const std::vector<float> act_sums = q4 ? block_sums(act_rows, d.F) : std::vector<float>();
  std::vector<const float*> act_sum_rows(rows, nullptr);
  if (q4) for (int64_t i = 0; i < rows; ++i) act_sum_rows[i] = act_sums.data() + i * (d.F / 32);
  std::vector<float> expert_out(rows * d.D);
  items = items_over(g, d.E, d.D, kDownRowsPerItem);
  auto down_item = [&](size_t i) {
    const Item& it = items[i];
    const int64_t first = g.start[it.expert], n = g.start[it.expert + 1] - first;
    down.dot(it.expert, it.r0, it.r1, act_rows.data() + first, act_sum_rows.data() + first, n,
             expert_out.data() + first * d.D + it.r0, d.D);
  };
  parallel_for(ctx, items.size(), down_item);

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
  Routing r{std::vector<int32_t>(d.T * d.top_k), std::vector<float>(d.T * d.top_k)};
  const size_t chunks = static_cast<size_t>((d.T + kRouterTokensPerItem - 1) / kRouterTokensPerItem);
  auto chunk = [&](size_t c) {
    const int64_t t0 = static_cast<int64_t>(c) * kRouterTokensPerItem;
    const int64_t n = std::min(d.T, t0 + kRouterTokensPerItem) - t0;
    std::vector<const float*> xs(n);
    for (int64_t t = 0; t < n; ++t) xs[t] = x + (t0 + t) * d.D;
    std::vector<float> logits(n * d.E);
    rows_dot_tokens(router, 0, d.E, d.D, xs.data(), n, logits.data(), d.E);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = (t0 + t) * d.top_k;
      route_token(logits.data() + t * d.E, d.E, d.top_k, normalize, r.expert.data() + slot, r.weight.data() + slot);
    }
  };
  parallel_for(ctx, chunks, chunk);
  return r;
}

using DmInput = std::optional<const Ort::Custom::Tensor<Ort::Float16_t>*>;

// W = float: float32 experts (no dm inputs); W = uint8_t: Q4_1 experts with their dm inputs.
template <typename W>
struct MoE {
  static constexpr bool kQ4 = std::is_same<W, uint8_t>::value;

  MoE(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    top_k_ = ki.GetAttribute<int64_t>("top_k");
    norm_topk_prob_ = ki.GetAttribute<int64_t>("norm_topk_prob") != 0;
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<float>& router,
                      const Ort::Custom::Tensor<W>& gate_up, const Ort::Custom::Tensor<W>& down, DmInput gate_up_dm,
                      DmInput down_dm, Ort::Custom::Tensor<float>& y) {
    try {
      const Dims d = check_shapes(x.Shape(), router.Shape(), gate_up.Shape(), down.Shape(), top_k_, kQ4);
      const ExpertStack gu = stack(gate_up, gate_up_dm, 2 * d.F, d.D, "gate_up");
      const ExpertStack dn = stack(down, down_dm, d.D, d.F, "down");
      float* out = y.Allocate(x.Shape());
      if (d.T == 0 || d.D == 0) return Ort::Status{nullptr};
      const Routing routing = route(ctx, d, x.Data(), router.Data(), norm_topk_prob_);
      moe_step(ctx, d, x.Data(), routing, gu, dn, out);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.MoE: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

 private:
  static ExpertStack stack(const Ort::Custom::Tensor<W>& w, DmInput dm, int64_t rows, int64_t K, const std::string& name) {
    ExpertStack s;
    s.rows = rows;
    s.K = K;
    if constexpr (kQ4) {
      if (!dm.has_value()) fail_moe("Q4_1 " + name + " needs its " + name + "_dm input");
      const std::vector<int64_t> want{w.Shape()[0], rows, K / 32, 2};
      if ((*dm)->Shape() != want)
        fail_moe(name + "_dm must be " + shape_text(want) + ", got " + shape_text((*dm)->Shape()));
      s.q = w.Data();
      s.dm = reinterpret_cast<const uint16_t*>((*dm)->Data());
    } else {
      if (dm.has_value()) fail_moe("float32 " + name + " takes no " + name + "_dm input");
      s.f = w.Data();
    }
    return s;
  }

  int64_t top_k_ = 1;
  bool norm_topk_prob_ = false;
};

}  // namespace

void add_moe(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MoE<float>>("MoE", "CPUExecutionProvider"));
  domain.Add(Ort::Custom::CreateLiteCustomOp<MoE<uint8_t>>("MoE", "CPUExecutionProvider"));
}

}  // namespace kiln
