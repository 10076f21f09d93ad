// The sampler's full-vocabulary work, called from runtime/sampler.py through ctypes (not an ORT op).
//
// Per row of float32 logits x (vocabulary V) with temperature T, top_k, top_p, min_p, the kept set is
// {x >= threshold}: min_p's threshold is max + T·log(min_p) in closed form; top_k's is the k-th largest
// logit, found among the tokens that reach the k-th largest maximum of 8k strided groups (one vertical
// max pass, one compare pass); top_p's is the logit of the last token of the nucleus, found from a
// histogram of the kept tokens' weights exp((x - max) / T) by their distance from the max: the bins
// above the one where the cumulative mass reaches top_p are whole, that bin alone is gathered and
// sorted. No row is sorted whole and no selection is retried. The draw is the inverse CDF in
// vocabulary order over the kept tokens, with one uniform per row: over the gathered candidates when
// top_k made them, else over 256-token block sums of the row and then within one block.
//
// Precision: the kept sets equal a float64 reference's. top_p's histogram is built from float32 weights
// with a bound on their error; a row whose cut that bound cannot decide is redone with float64 weights.
// The draws read float32 weights with float64 sums (a probability moves by ~1e-7 relative). Rows are
// independent: a row's result never depends on the other rows.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "sampling_simd.h"

namespace kiln_sampling {
namespace {

constexpr int64_t kBlock = 256;            // tokens per block of the full-row inverse CDF
constexpr int kBins = 1024;                // top_p histogram bins; the last one holds everything further
constexpr int kNearBins = 256;             // the float32 pass's bins: (max - x) / T < 16, then one more
constexpr double kBinsPerUnit = 16.0;      // bins per unit of (max - x) / T
constexpr int64_t kGroupsPerCandidate = 8;  // strided groups per wanted top_k candidate
constexpr int64_t kMinGroups = 1024;

// A row's tokens at or above a floor, in vocabulary order.
struct Candidates {
  std::vector<float> value;
  std::vector<int64_t> id;

  void gather(const float* x, int64_t n, float floor) {
    value.clear();
    id.clear();
    const __m256 f = _mm256_set1_ps(floor);
    for (int64_t i = 0; i < n; i += 8) {
      unsigned mask = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, i, n), f, _CMP_GE_OQ));
      while (mask) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        if (i + j < n) {
          value.push_back(x[i + j]);
          id.push_back(i + j);
        }
      }
    }
  }
};

// The k-th largest of values (1 <= k <= size), using scratch.
float kth_largest(const std::vector<float>& values, int64_t k, std::vector<float>& scratch) {
  scratch.assign(values.begin(), values.end());
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  return scratch[k - 1];
}

// Gathers into cands a set of tokens holding the row's k largest (every token >= a floor that at least
// k tokens reach: the k-th largest maximum of strided groups), and returns the k-th largest logit.
float top_k_threshold(const float* x, int64_t n, int64_t k, Candidates& cands, std::vector<float>& scratch) {
  int64_t groups = std::max(k * kGroupsPerCandidate, kMinGroups);
  groups = (groups + 7) / 8 * 8;
  if (2 * groups > n) {  // too few groups to save anything: the whole row is the candidate set
    cands.gather(x, n, kNegInf);
    return kth_largest(cands.value, k, scratch);
  }
  // Group j holds tokens j, j + groups, ...; the tail past the last whole stride are groups of one.
  const int64_t body = n - n % groups;
  scratch.assign(x, x + groups);
  for (int64_t c = groups; c < body; c += groups)
    for (int64_t j = 0; j < groups; j += 8)
      _mm256_storeu_ps(scratch.data() + j, _mm256_max_ps(_mm256_loadu_ps(scratch.data() + j), _mm256_loadu_ps(x + c + j)));
  scratch.insert(scratch.end(), x + body, x + n);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  cands.gather(x, n, scratch[k - 1]);
  return kth_largest(cands.value, k, scratch);
}

// Indices of the candidates with value >= threshold, most likely first (ties in vocabulary order).
void descending_kept(const Candidates& cands, float threshold, std::vector<int64_t>& order) {
  order.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(cands.value.size()); ++i)
    if (cands.value[i] >= threshold) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cands.value[a] > cands.value[b]; });
}

// top_p's threshold among candidates that hold every token >= threshold: the logit of the first token,
// most likely first, at which the cumulative weight reaches top_p of the kept weight.
float top_p_among(const Candidates& cands, float threshold, double max, double inv_t, double top_p,
                  std::vector<int64_t>& order) {
  descending_kept(cands, threshold, order);
  std::vector<double> w(order.size());
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i) total += (w[i] = weight1(cands.value[order[i]], threshold, max, inv_t));
  const double target = top_p * total;
  double cumulative = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    cumulative += w[i];
    if (cumulative >= target && w[i] > 0) return cands.value[order[i]];
  }
  return threshold;  // rounding kept the mass below target: keep everything
}

// Each logit's histogram bin: its distance from the max in 1/16 units of (max - x) / T, the last bin
// holding everything further.
inline __m256i bins8(__m256 x, float max, float bin_scale, int last_bin) {
  const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(max), x), _mm256_set1_ps(bin_scale));
  // min_ps returns its second operand for NaN (x = -inf gives d = inf): such tokens land in the last bin
  return _mm256_cvttps_epi32(_mm256_min_ps(d, _mm256_set1_ps(static_cast<float>(last_bin))));
}

// Where top_p's cumulative mass crosses its target: the cut (the logit of the nucleus' last token) and
// the cumulative weights just before and at that token. found is false only if rounding kept every sum
// short of the target.
struct Cut {
  float value;
  double target, before, at;
  bool found;
  int bin;  // where it was found
};

// The cut from a histogram of the kept tokens' weights by distance from the max: walks the bins to the
// one where the cumulative weight reaches top_p of the total, gathers and sorts that bin alone.
template <typename W>
Cut find_cut(const float* x, int64_t n, float threshold, float max, float bin_scale, const std::vector<double>& mass,
             const std::vector<W>& weights, double top_p, Candidates& bin, std::vector<int64_t>& order) {
  double total = 0.0;
  for (double m : mass) total += m;
  Cut cut{threshold, top_p * total, 0.0, 0.0, false, 0};
  const int bins = static_cast<int>(mass.size());
  int first = 0;
  while (first < bins - 1 && cut.at + mass[first] < cut.target) cut.at += mass[first++];
  const __m256 t = _mm256_set1_ps(threshold);
  // Rounding may leave the crossing in a later bin than the sums say: walk on until it is found.
  for (int k = first; k < bins; ++k) {
    if (mass[k] == 0.0) continue;
    bin.value.clear();
    bin.id.clear();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = load8(x, i, n);
      unsigned in = _mm256_movemask_ps(_mm256_and_ps(
          _mm256_cmp_ps(v, t, _CMP_GE_OQ),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(bins8(v, max, bin_scale, bins - 1), _mm256_set1_epi32(k)))));
      while (in) {
        const int j = __builtin_ctz(in);
        in &= in - 1;
        if (i + j < n) {
          bin.value.push_back(x[i + j]);
          bin.id.push_back(i + j);
        }
      }
    }
    descending_kept(bin, threshold, order);
    for (int64_t i : order) {
      const double w = weights[bin.id[i]];
      cut.before = cut.at;
      cut.at += w;
      if (cut.at >= cut.target && w > 0) {
        cut.value = bin.value[i];
        cut.found = true;
        cut.bin = k;
        return cut;
      }
    }
  }
  return cut;
}

// top_p's threshold over a whole row whose kept tokens are those >= threshold, from float64 weights:
// exact up to float64 rounding. Leaves every token's weight (0 below threshold) in weights.
float top_p_exact(const float* x, int64_t n, float threshold, float max, double inv_t, double top_p,
                  std::vector<double>& weights, Candidates& bin, std::vector<int64_t>& order) {
  const float bin_scale = static_cast<float>(inv_t * kBinsPerUnit);
  std::vector<double> mass(kBins, 0.0);
  weights.resize((n + 7) / 8 * 8);
  alignas(32) int32_t b[8];
  const __m256 t = _mm256_set1_ps(threshold);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = load8(x, i, n);
    double* w = weights.data() + i;
    if (!_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ))) {
      _mm256_storeu_pd(w, _mm256_setzero_pd());
      _mm256_storeu_pd(w + 4, _mm256_setzero_pd());
      continue;
    }
    weights8(v, threshold, max, inv_t, w);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), bins8(v, max, bin_scale, kBins - 1));
    for (int j = 0; j < 8; ++j) mass[b[j]] += w[j];  // 0 for tokens below threshold and past n
  }
  const Cut cut = find_cut(x, n, threshold, max, bin_scale, mass, weights, top_p, bin, order);
  return cut.value;
}

// The same from float32 weights (a third of the float64 pass's cost), with a bound on their error: each
// weight is within (|a| + 2)·2^-21 of exp(a) relative (a = (x - max) / T rounded to float, Cephes exp),
// and a token below exp's float range is within e^-87 absolute. Only tokens within 16 of the max in
// (max - x) / T are binned one by one; the rest are summed 8 at a time into the last bin. Returns false
// when the cut lies in that last bin, or the sums at the cut lie within twice the error bound of the
// target: the float64 pass must then decide.
bool top_p_fast(const float* x, int64_t n, float threshold, float max, double inv_t, double top_p,
                std::vector<float>& weights, Candidates& bin, std::vector<int64_t>& order, float* cut_out) {
  const float bin_scale = static_cast<float>(inv_t * kBinsPerUnit), inv_tf = static_cast<float>(inv_t);
  std::vector<double> mass(kNearBins + 1, 0.0);
  weights.resize((n + 7) / 8 * 8);
  alignas(32) int32_t b[8];
  const __m256 t = _mm256_set1_ps(threshold), near = _mm256_set1_ps(static_cast<float>(kNearBins));
  const __m256 per_unit = _mm256_set1_ps(static_cast<float>(1.0 / kBinsPerUnit)), two = _mm256_set1_ps(2.f);
  const __m256 far = _mm256_set1_ps(static_cast<float>(kBins) * static_cast<float>(kBinsPerUnit));
  __m256 error = _mm256_setzero_ps();
  __m256d far_lo = _mm256_setzero_pd(), far_hi = far_lo;  // float64 sums: their rounding stays negligible
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = load8(x, i, n);
    float* w = weights.data() + i;
    if (!_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ))) {
      _mm256_storeu_ps(w, _mm256_setzero_ps());
      continue;
    }
    const __m256 wv = weights8f(v, threshold, max, inv_tf);
    _mm256_storeu_ps(w, wv);
    const __m256 d = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(max), v), _mm256_set1_ps(bin_scale)), far);
    error = _mm256_fmadd_ps(wv, _mm256_fmadd_ps(d, per_unit, two), error);  // w·(|a| + 2)
    const __m256 is_near = _mm256_cmp_ps(d, near, _CMP_LT_OQ);
    const __m256 far_w = _mm256_andnot_ps(is_near, wv);
    far_lo = _mm256_add_pd(far_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(far_w)));
    far_hi = _mm256_add_pd(far_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(far_w, 1)));
    unsigned lanes = _mm256_movemask_ps(is_near);
    if (!lanes) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), _mm256_cvttps_epi32(d));
    while (lanes) {
      const int j = __builtin_ctz(lanes);
      lanes &= lanes - 1;
      mass[b[j]] += w[j];
    }
  }
  alignas(32) double far_lanes[4];
  _mm256_store_pd(far_lanes, _mm256_add_pd(far_lo, far_hi));
  mass[kNearBins] = (far_lanes[0] + far_lanes[1]) + (far_lanes[2] + far_lanes[3]);
  alignas(32) float lanes[8];  // the bound itself needs no precision: it is used with a factor 2 to spare
  _mm256_store_ps(lanes, error);
  double bound = static_cast<double>(n) * 1.7e-38;  // tokens below exp's float range count 0
  for (float e : lanes) bound += std::ldexp(static_cast<double>(e), -21);
  const Cut cut = find_cut(x, n, threshold, max, bin_scale, mass, weights, top_p, bin, order);
  *cut_out = cut.value;
  return cut.found && cut.bin < kNearBins && cut.target - cut.before > 2 * bound && cut.at - cut.target > 2 * bound;
}

// Inverse CDF in vocabulary order over candidates (all tokens >= threshold among them).
int64_t draw_among(const Candidates& cands, float threshold, double max, double inv_t, double u) {
  std::vector<double> w(cands.value.size());
  double total = 0.0;
  for (size_t i = 0; i < w.size(); ++i) total += (w[i] = weight1(cands.value[i], threshold, max, inv_t));
  const double target = std::max(u * total, std::numeric_limits<double>::min());
  double cumulative = 0.0;
  int64_t last = -1;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0) continue;
    cumulative += w[i];
    last = cands.id[i];
    if (cumulative >= target) return last;
  }
  return last;
}

// The block of an inverse-CDF draw from per-block sums: target = u * total, the first block with mass whose
// running sum reaches it (rounding past the end: the last block with mass), and the mass before that block.
struct BlockPick {
  int64_t block;
  double before, target;
};

BlockPick pick_block(const std::vector<double>& sums, double u) {
  const int64_t blocks = static_cast<int64_t>(sums.size());
  double total = 0.0;
  for (double s : sums) total += s;
  const double target = std::max(u * total, std::numeric_limits<double>::min());
  double before = 0.0;
  int64_t blk = 0, last_with_mass = 0;
  for (; blk < blocks; ++blk) {
    if (sums[blk] > 0) last_with_mass = blk;
    if (sums[blk] > 0 && before + sums[blk] >= target) break;
    before += sums[blk];
  }
  if (blk == blocks) blk = last_with_mass;
  return {blk, before, target};
}

// Inverse CDF in vocabulary order over a whole row: block sums find the block, then the token in it
// (float32 weights, float64 sums).
int64_t draw_over_row(const float* x, int64_t n, float threshold, float max, double inv_t, double u,
                      std::vector<double>& sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const float inv_tf = static_cast<float>(inv_t);
  sums.assign(blocks, 0.0);
  const __m256 t = _mm256_set1_ps(threshold);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    const int64_t end = std::min(n, (blk + 1) * kBlock);
    int64_t i = blk * kBlock;
    for (; i + 16 <= end; i += 16) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
      if (!_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, t, _CMP_GE_OQ), _mm256_cmp_ps(b, t, _CMP_GE_OQ))))
        continue;
      acc0 = _mm256_add_ps(acc0, weights8f(a, threshold, max, inv_tf));
      acc1 = _mm256_add_ps(acc1, weights8f(b, threshold, max, inv_tf));
    }
    for (; i < end; i += 8) acc0 = _mm256_add_ps(acc0, weights8f(load8(x, i, n), threshold, max, inv_tf));
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    const __m256d wide = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(acc)),
                                       _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, wide);
    sums[blk] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  const BlockPick pick = pick_block(sums, u);
  const double target = pick.target;
  double before = pick.before;
  const int64_t blk = pick.block;
  int64_t last = -1;
  const int64_t end = std::min(n, (blk + 1) * kBlock);
  alignas(32) float w[8];
  for (int64_t i = blk * kBlock; i < end; i += 8) {
    _mm256_store_ps(w, weights8f(load8(x, i, n), threshold, max, inv_tf));
    for (int j = 0; j < 8 && i + j < end; ++j) {
      if (w[j] <= 0) continue;
      before += w[j];
      last = i + j;
      if (before >= target) return last;
    }
  }
  return last;  // rounding left the block's sum short of target: its last token with mass
}

// Inverse CDF in vocabulary order over the tokens >= threshold, from their weights already computed.
template <typename W>
int64_t draw_from_weights(const float* x, int64_t n, float threshold, const std::vector<W>& weights, double u,
                          std::vector<double>& sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.assign(blocks, 0.0);
  const __m256 t = _mm256_set1_ps(threshold);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    double sum = 0.0;
    const int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; i += 8) {
      unsigned kept = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, i, n), t, _CMP_GE_OQ));
      while (kept) {  // few tokens pass top_p's cut: add them one by one
        const int j = __builtin_ctz(kept);
        kept &= kept - 1;
        sum += weights[i + j];  // 0 past n
      }
    }
    sums[blk] = sum;
  }
  const BlockPick pick = pick_block(sums, u);
  const double target = pick.target;
  double before = pick.before;
  const int64_t blk = pick.block;
  int64_t last = -1;
  for (int64_t i = blk * kBlock; i < std::min(n, (blk + 1) * kBlock); ++i) {
    if (!(x[i] >= threshold) || weights[i] <= 0) continue;
    before += weights[i];
    last = i;
    if (before >= target) return last;
  }
  return last;
}

struct Scratch {
  Candidates cands, bin;
  std::vector<float> values;
  std::vector<int64_t> order;
  std::vector<double> sums, weights;
  std::vector<float> weights_f;
};

// One row: its keep threshold, and (when uniform >= 0) its token. Returns false for a row with a NaN, an
// infinite maximum or no finite logit.
bool sample_row(const float* x, int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                double uniform, float* threshold_out, int64_t* token_out, Scratch& s) {
  const float max = row_max(x, n);
  if (!std::isfinite(max)) return false;
  const double inv_t = 1.0 / temperature;
  float threshold = min_p > 0 ? float_at_least(static_cast<double>(max) + temperature * std::log(min_p)) : kNegInf;
  const bool by_k = top_k > 0 && top_k < n;
  if (by_k) threshold = std::max(threshold, top_k_threshold(x, n, top_k, s.cands, s.values));
  const bool by_p = top_p < 1;
  bool fast = false;  // top_p's cut came from float32 weights (certified), which the draw then uses
  if (by_p && by_k) {
    threshold = top_p_among(s.cands, threshold, max, inv_t, top_p, s.order);
  } else if (by_p) {
    float cut;
    fast = top_p_fast(x, n, threshold, max, inv_t, top_p, s.weights_f, s.bin, s.order, &cut);
    threshold = fast ? cut : top_p_exact(x, n, threshold, max, inv_t, top_p, s.weights, s.bin, s.order);
  }
  *threshold_out = threshold;
  if (uniform < 0) return true;
  if (by_k)
    *token_out = draw_among(s.cands, threshold, max, inv_t, uniform);
  else if (by_p)
    *token_out = fast ? draw_from_weights(x, n, threshold, s.weights_f, uniform, s.sums)
                      : draw_from_weights(x, n, threshold, s.weights, uniform, s.sums);
  else
    *token_out = draw_over_row(x, n, threshold, max, inv_t, uniform, s.sums);
  return true;
}

// The k largest logits of a row and their ids, most likely first (ties in vocabulary order). A NaN, which no
// order places, comes after every number (numpy's sort does the same), NaNs in vocabulary order: the strided
// selection needs a total order, so a row holding one takes the plain path, whose gather (>=) drops NaNs.
void top_tokens_row(const float* x, int64_t n, int64_t k, int64_t* ids, float* values, Scratch& s) {
  const bool has_nan = std::isnan(row_max(x, n));
  if (k < n && !has_nan) {
    const float kth = top_k_threshold(x, n, k, s.cands, s.values);
    descending_kept(s.cands, kth, s.order);
  } else {
    s.cands.gather(x, n, kNegInf);
    descending_kept(s.cands, kNegInf, s.order);
  }
  int64_t i = 0;
  for (; i < k && i < static_cast<int64_t>(s.order.size()); ++i) {
    ids[i] = s.cands.id[s.order[i]];
    values[i] = s.cands.value[s.order[i]];
  }
  for (int64_t t = 0; i < k; ++t)  // fewer numbers than k: the NaNs (k <= n, so enough of them)
    if (std::isnan(x[t])) ids[i] = t, values[i++] = x[t];
}

}  // namespace
}  // namespace kiln_sampling

extern "C" {

// Per row r of logits [rows, vocab] (rows contiguous): thresholds[r], the logit from which on tokens stay
// in the distribution after min_p, top_k and top_p (top_k 0: off; top_p 1: off; min_p 0: off), and, when
// uniforms is not null, tokens[r], the inverse CDF of that distribution at uniforms[r] in [0, 1).
// Returns 0, or r + 1 for the first row with a NaN, +inf or no finite logit (its outputs are left unset; other
// rows' may be set).
// Up to `threads` threads take contiguous ranges of at least kRowsPerThread rows (the calling thread one of them):
// rows are independent, so the results do not depend on the split. A top_p row of SmolLM2's 49,152 logits takes
// ~0.1 ms, so a batch of 32 is ~3.5 ms, 13% of a 2-thread decode step on one thread (docs/design.md, "Sampler").
__attribute__((visibility("default"))) int64_t kiln_sample_rows_on_threads(
    const float* logits, int64_t rows, int64_t vocab, const double* temperature, const int64_t* top_k,
    const double* top_p, const double* min_p, const double* uniforms, float* thresholds, int64_t* tokens,
    int64_t threads) {
  auto range = [&](int64_t begin, int64_t end) -> int64_t {
    kiln_sampling::Scratch scratch;
    int64_t ignored = 0;
    for (int64_t r = begin; r < end; ++r) {
      if (!kiln_sampling::sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                                     uniforms ? uniforms[r] : -1.0, thresholds + r,
                                     uniforms ? tokens + r : &ignored, scratch))
        return r + 1;
    }
    return 0;
  };
  constexpr int64_t kRowsPerThread = 4;  // a thread's start costs about one row
  const int64_t parts = std::max<int64_t>(1, std::min(threads, rows / kRowsPerThread));
  if (parts == 1) return range(0, rows);
  std::vector<int64_t> failed(parts, 0);
  std::vector<std::thread> helpers;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t begin = rows * i / parts, end = rows * (i + 1) / parts;
    try {
      helpers.emplace_back([&failed, &range, i, begin, end] { failed[i] = range(begin, end); });
    } catch (const std::system_error&) {  // no thread to be had: this one does the range
      failed[i] = range(begin, end);
    }
  }
  failed[0] = range(0, rows / parts);
  for (std::thread& helper : helpers) helper.join();
  for (const int64_t f : failed)  // ranges in row order: the first failure is the lowest row
    if (f) return f;
  return 0;
}

// Per row of logits [rows, vocab]: the ids and logits of its k largest (1 <= k <= vocab), most likely first,
// ties in vocabulary order, NaNs last, into ids / values [rows, k].
__attribute__((visibility("default"))) void kiln_top_tokens(const float* logits, int64_t rows, int64_t vocab,
                                                            int64_t k, int64_t* ids, float* values) {
  kiln_sampling::Scratch scratch;
  for (int64_t r = 0; r < rows; ++r)
    kiln_sampling::top_tokens_row(logits + r * vocab, vocab, k, ids + r * k, values + r * k, scratch);
}

}  // extern "C"
