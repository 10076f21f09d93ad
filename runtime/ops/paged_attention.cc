// kiln.PagedAttention (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, outputs, attributes, semantics) is written once, with its numpy
// reference implementation, in kiln/paged_attention.py; this file implements it.
//
//   1. validate every input against the others (no out-of-bounds read on bad input);
//   2. if kv_cache_out is not the same buffer as kv_cache, copy the pool (slow fallback); with q_norm / k_norm,
//      the normalised query and key rows into a buffer of the op's own (the value rows too when packed);
//   3. write the new tokens' K/V into their slots of kv_cache_out (K rotated first when cos/sin
//      are given; int8 pools: quantized with the per-KV-head steps of kv_scale [2, Hkv]);
//      attend_until [T], when given, lets each token see up to that position (Gemma 3's image runs);
//   4. attention: work items (sequence, kv head, chunk of query tokens, context partition)
//      run on ONNX Runtime's intra-op thread pool; each streams the (block, head) K/V
//      tiles once for all query heads of its group (queries rotated as they are loaded), with a
//      flash-style online softmax;
//   5. items that split one long context (decode with few sequences) are merged.
//
// Built with -O3 -mavx2 -mfma -mf16c; RegisterCustomOps refuses to load without AVX2.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "all_reduce.h"
#include "matmul_gguf.h"
#include "matmul_q4_1.h"
#include "moe.h"
#include "parallel_for.h"
#include "rescore_logits.h"
#include "paged_attention_kernel.h"
#include "swiglu.h"
#include "validate.h"

namespace kiln {

constexpr int kAbiVersion = 15;  // kiln.contract.OP_LIBRARY_ABI

// ---------------------------------------------------------------- the op

struct Rotary {  // the optional 9th and 10th inputs; both nullptr when Q/K arrive rotated
  const Ort::Custom::Tensor<float>* cos;
  const Ort::Custom::Tensor<float>* sin;
};

struct QkNorm {  // the optional 12th and 13th inputs; both nullptr when Q/K arrive normalised
  const Ort::Custom::Tensor<float>* q;
  const Ort::Custom::Tensor<float>* k;
};

// y = x * w / sqrt(mean(x^2) + epsilon) over each group of `group` values of a row of `width` (a head: w [D]; the
// row: w [width]): SimplifiedLayerNormalization's arithmetic, the squares summed in double as the spec does, 8 lanes
// at a time (a decode step normalises a few thousand values a layer, no more than ONNX Runtime's own norm costs).
static void rms_norm_groups(const float* x, const float* w, int64_t width, int64_t group, float epsilon, float* y) {
  for (int64_t g0 = 0; g0 < width; g0 += group) {
    const float* xg = x + g0;
    float* yg = y + g0;
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= group; i += 8) {
      const __m256 v = _mm256_loadu_ps(xg + i);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      acc0 = _mm256_fmadd_pd(lo, lo, acc0);  // a float's square is exact in double: fused or not, the same
      acc1 = _mm256_fmadd_pd(hi, hi, acc1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
    double squares = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (int64_t j = i; j < group; ++j) squares += static_cast<double>(xg[j]) * xg[j];
    const float root = static_cast<float>(std::sqrt(squares / static_cast<double>(group) + epsilon));
    const __m256 r = _mm256_set1_ps(root);
    for (i = 0; i + 8 <= group; i += 8)
      _mm256_storeu_ps(yg + i, _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(xg + i), r), _mm256_loadu_ps(w + i)));
    for (; i < group; ++i) yg[i] = xg[i] / root * w[i];
  }
}

// The norm weight's group: D (per head) or the projection's width (the whole row); else a clear error.
static int64_t norm_group(const Ort::Custom::Tensor<float>& w, const char* name, int64_t heads, int64_t D) {
  const auto& shape = w.Shape();
  if (shape.size() != 1 || (shape[0] != D && shape[0] != heads * D))
    fail(std::string(name) + " must be float32 [head_dim=" + std::to_string(D) + "] (per head) or [" +
         std::to_string(heads * D) + "] (the whole projection), got " + shape_text(shape));
  return shape[0];
}

template <typename KvT>
struct PagedAttention {
  PagedAttention(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    num_heads_ = ki.GetAttribute<int64_t>("num_heads");
    num_kv_heads_ = ki.GetAttribute<int64_t>("num_kv_heads");
    try { scale_ = ki.GetAttribute<float>("scale"); } catch (const Ort::Exception&) { scale_ = 0.f; }
    try { window_ = ki.GetAttribute<int64_t>("sliding_window"); } catch (const Ort::Exception&) { window_ = 0; }
    try { softcap_ = ki.GetAttribute<float>("softcap"); } catch (const Ort::Exception&) { softcap_ = 0.f; }
    try {
      qk_norm_epsilon_ = ki.GetAttribute<float>("qk_norm_epsilon");
    } catch (const Ort::Exception&) {
      qk_norm_epsilon_ = 1e-6f;  // kiln.paged_attention.QK_NORM_EPSILON
    }
    try {
      interleaved_ = ki.GetAttribute<int64_t>("rotary_interleaved");
    } catch (const Ort::Exception&) {
      interleaved_ = 0;
    }
  }

  // An empty [0] tensor stands for an absent optional input (ORT cannot skip an input before a trailing one).
  template <typename T>
  static const Ort::Custom::Tensor<T>* present(const Ort::Custom::Tensor<T>* t) {
    return t != nullptr && t->Shape().size() == 1 && t->Shape()[0] == 0 ? nullptr : t;
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& query, const Ort::Custom::Tensor<float>& key,
                      const Ort::Custom::Tensor<float>& value, const Ort::Custom::Tensor<KvT>& kv_cache,
                      const Ort::Custom::Tensor<int32_t>& block_tables, const Ort::Custom::Tensor<int32_t>& seq_lens,
                      const Ort::Custom::Tensor<int32_t>& query_start_loc,
                      std::optional<const Ort::Custom::Tensor<float>*> kv_scale,
                      std::optional<const Ort::Custom::Tensor<float>*> cos_cache,
                      std::optional<const Ort::Custom::Tensor<float>*> sin_cache,
                      std::optional<const Ort::Custom::Tensor<int32_t>*> attend_until,
                      std::optional<const Ort::Custom::Tensor<float>*> q_norm,
                      std::optional<const Ort::Custom::Tensor<float>*> k_norm, Ort::Custom::Tensor<float>& out,
                      Ort::Custom::Tensor<KvT>& kv_cache_out) {
    try {
      const Rotary rotary{present(cos_cache.value_or(nullptr)), present(sin_cache.value_or(nullptr))};
      const QkNorm norms{present(q_norm.value_or(nullptr)), present(k_norm.value_or(nullptr))};
      run(ctx, query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale.value_or(nullptr), rotary,
          present(attend_until.value_or(nullptr)), norms, out, kv_cache_out);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.PagedAttention: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& query, const Ort::Custom::Tensor<float>& key,
           const Ort::Custom::Tensor<float>& value, const Ort::Custom::Tensor<KvT>& kv_cache,
           const Ort::Custom::Tensor<int32_t>& block_tables, const Ort::Custom::Tensor<int32_t>& seq_lens,
           const Ort::Custom::Tensor<int32_t>& query_start_loc, const Ort::Custom::Tensor<float>* kv_scale,
           const Rotary& rotary, const Ort::Custom::Tensor<int32_t>* attend_until, const QkNorm& norms,
           Ort::Custom::Tensor<float>& out, Ort::Custom::Tensor<KvT>& kv_cache_out) const {
    if (window_ < 0) fail("sliding_window must be >= 0");
    if (!(softcap_ >= 0.f) || std::isinf(softcap_)) fail("softcap must be finite and >= 0 (0 = off)");
    if (interleaved_ != 0 && interleaved_ != 1) fail("rotary_interleaved must be 0 (rotate_half) or 1 (adjacent pairs)");
    if ((rotary.cos == nullptr) != (rotary.sin == nullptr)) fail("cos_cache and sin_cache come together (RoPE needs both)");
    const auto& pool_shape = kv_cache.Shape();
    const QkvLayout qkv = validate_qkv(query.Shape(), key.Shape(), value.Shape(), num_heads_, num_kv_heads_);
    validate(pool_shape, block_tables.Shape(), seq_lens.Shape(), query_start_loc.Shape(), num_kv_heads_, qkv.head_dim);
    const int64_t T = qkv.num_tokens, S = block_tables.Shape()[0], max_blocks = block_tables.Shape()[1];
    const int64_t D = qkv.head_dim, bs = pool_shape[3];
    validate_values(block_tables.Data(), seq_lens.Data(), query_start_loc.Data(), S, max_blocks, T, pool_shape[0], bs, window_);
    const float* steps = nullptr;
    if (kv_scale != nullptr && kv_scale->Shape().size() == 1 && kv_scale->Shape()[0] == 0)
      kv_scale = nullptr;  // an empty tensor stands for an absent optional input
    if (is_int8<KvT>()) {
      if (kv_scale == nullptr)
        fail("an int8 kv_cache needs the 8th input kv_scale float32 [2, num_kv_heads=" + std::to_string(num_kv_heads_) +
             "] (row 0 K steps, row 1 V steps)");
      validate_kv_scale(kv_scale->Shape(), kv_scale->Data(), num_kv_heads_);
      steps = kv_scale->Data();
    } else if (kv_scale != nullptr) {
      fail("kv_scale is only for an int8 kv_cache; this kv_cache is " + std::string(is_f16<KvT>() ? "float16" : "float32"));
    }

    Problem<KvT> p{};
    p.q = query.Data();
    if (qkv.packed) {  // one row per token: its H query heads, then Hkv key heads, then Hkv value heads
      p.k = p.q + num_heads_ * D;
      p.v = p.k + num_kv_heads_ * D;
      p.q_stride = p.kv_stride = (num_heads_ + 2 * num_kv_heads_) * D;
    } else {
      p.k = key.Data();
      p.v = value.Data();
      p.q_stride = num_heads_ * D;
      p.kv_stride = num_kv_heads_ * D;
    }
    p.block_tables = block_tables.Data();
    p.seq_lens = seq_lens.Data();
    p.qsl = query_start_loc.Data();
    p.num_tokens = T;
    p.H = num_heads_;
    p.Hkv = num_kv_heads_;
    p.D = D;
    p.G = num_heads_ / num_kv_heads_;
    p.block_size = bs;
    p.max_blocks = max_blocks;
    p.scale = scale_ > 0.f ? scale_ : 1.f / std::sqrt(static_cast<float>(D));
    p.window = window_;
    p.softcap = softcap_;
    p.kv_scale = steps;
    if (rotary.cos != nullptr) {
      validate_rotary(rotary.cos->Shape(), rotary.sin->Shape(), D, p.seq_lens, p.qsl, S);
      p.cos = rotary.cos->Data();
      p.sin = rotary.sin->Data();
      p.rot_half = rotary.cos->Shape()[1];
      p.interleaved = interleaved_ == 1;
    }
    if (attend_until != nullptr) {
      validate_attend_until(attend_until->Shape(), attend_until->Data(), p.seq_lens, p.qsl, S, T);
      p.until = attend_until->Data();
    }
    p.out = qkv.batch_of_one ? out.Allocate({1, T, num_heads_ * D}) : out.Allocate({T, num_heads_ * D});
    p.pool = kv_cache_out.Allocate(pool_shape);
    if (static_cast<const void*>(p.pool) != static_cast<const void*>(kv_cache.Data()))
      std::memcpy(p.pool, kv_cache.Data(), kv_cache.SizeInBytes());  // not aliased: correct but O(pool)
    if (T == 0) return;
    std::vector<float> normed;  // the normalised rows, which p.q and p.k then point into
    if (norms.q != nullptr || norms.k != nullptr) normalize_query_key(ctx, norms, qkv.packed, p, normed);

    std::vector<int32_t> token_seq(T);
    for (int64_t s = 0; s < S; ++s)
      for (int32_t t = p.qsl[s]; t < p.qsl[s + 1]; ++t) token_seq[t] = static_cast<int32_t>(s);
    auto write = [&](size_t t) { write_token(p, token_seq[t], static_cast<int64_t>(t)); };
    if (T * p.Hkv * D >= 65536) parallel_for(ctx, T, write);
    else for (int64_t t = 0; t < T; ++t) write(t);

    const bool serial = attention_work(p, S) < kSerialWork;
    std::vector<WorkItem> items;
    std::vector<SplitGroup> groups;
    std::vector<float> partials(static_cast<size_t>(plan(p, S, serial, items, groups) * (D + 2)));
    p.partials = partials.data();
    // ORT's pool hands a thread the items in order (from its own shard): the next item is most often its next
    auto attend = [&](size_t i) { run_item(p, items[i], i + 1 < items.size() ? &items[i + 1] : nullptr); };
    if (serial) for (size_t i = 0; i < items.size(); ++i) attend(i);
    else parallel_for(ctx, items.size(), attend);
    auto merge = [&](size_t i) { merge_group(p, groups[i]); };
    if (partials.size() >= 65536) parallel_for(ctx, groups.size(), merge);
    else for (size_t i = 0; i < groups.size(); ++i) merge(i);  // cheaper than waking the pool
  }

  // p's query and key rows RMS-normalised into `normed` (packed: whole rows, the value heads copied, so the strides
  // stay the packed row's; else the query rows, then the key rows), and p pointed at them.
  void normalize_query_key(OrtKernelContext* ctx, const QkNorm& norms, bool packed, Problem<KvT>& p,
                           std::vector<float>& normed) const {
    if (norms.q == nullptr || norms.k == nullptr) fail("q_norm and k_norm come together (both or neither)");
    if (!(qk_norm_epsilon_ > 0.f) || std::isinf(qk_norm_epsilon_)) fail("qk_norm_epsilon must be finite and > 0");
    const int64_t T = p.num_tokens, D = p.D, q_width = p.H * D, k_width = p.Hkv * D;
    const int64_t q_group = norm_group(*norms.q, "q_norm", p.H, D), k_group = norm_group(*norms.k, "k_norm", p.Hkv, D);
    const int64_t row = packed ? p.q_stride : q_width + k_width;
    normed.resize(static_cast<size_t>(T * row));
    float* q = normed.data();
    float* k = packed ? q + q_width : q + T * q_width;
    const int64_t q_stride = packed ? row : q_width, k_stride = packed ? row : k_width;
    auto token = [&](size_t i) {
      const int64_t t = static_cast<int64_t>(i);
      rms_norm_groups(p.q + t * p.q_stride, norms.q->Data(), q_width, q_group, qk_norm_epsilon_, q + t * q_stride);
      rms_norm_groups(p.k + t * p.kv_stride, norms.k->Data(), k_width, k_group, qk_norm_epsilon_, k + t * k_stride);
      if (packed) std::memcpy(k + t * k_stride + k_width, p.v + t * p.kv_stride, k_width * sizeof(float));
    };
    if (T * row >= 65536) parallel_for(ctx, static_cast<size_t>(T), token);
    else for (int64_t t = 0; t < T; ++t) token(static_cast<size_t>(t));
    p.q = q;
    p.k = k;
    if (packed) p.v = k + k_width;  // the strides are the packed row's as before
  }

  int64_t num_heads_ = 0, num_kv_heads_ = 0, window_ = 0, interleaved_ = 0;
  float scale_ = 0.f, softcap_ = 0.f, qk_norm_epsilon_ = 1e-6f;
};

}  // namespace kiln

extern "C" {

__attribute__((visibility("default"))) int kiln_ops_abi_version() { return kiln::kAbiVersion; }

// The instruction set this copy of the library was compiled for (build_ops.VARIANTS).
__attribute__((visibility("default"))) const char* kiln_ops_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#else
  return "avx2";
#endif
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const std::string msg = std::string("libkiln_ops was built against ONNX Runtime API version ") +
                            std::to_string(ORT_API_VERSION) + ", newer than this onnxruntime (" +
                            api_base->GetVersionString() + "); upgrade onnxruntime";
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, msg.c_str());
  }
  Ort::InitApi(api);
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    return api->CreateStatus(ORT_FAIL, "libkiln_ops needs a CPU with AVX2, FMA and F16C");
  static std::mutex mu;
  static Ort::CustomOpDomain* domain = nullptr;  // deliberately never freed: sessions keep pointers into it
  try {
    std::lock_guard<std::mutex> lock(mu);
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain("kiln");
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<float>>("PagedAttention", "CPUExecutionProvider"));
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<Ort::Float16_t>>("PagedAttention", "CPUExecutionProvider"));
      domain->Add(Ort::Custom::CreateLiteCustomOp<kiln::PagedAttention<int8_t>>("PagedAttention", "CPUExecutionProvider"));
      kiln::add_matmul_q4_1(*domain);
      kiln::add_matmul_gguf(*domain);
      kiln::add_swiglu(*domain);
      kiln::add_moe(*domain);
      kiln::add_rescore_logits(*domain);
      kiln::add_all_reduce(*domain);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

}  // extern "C"
