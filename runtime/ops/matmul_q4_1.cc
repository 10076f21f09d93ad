// kiln.MatMulQ4_1 (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, weight layout, semantics) is written once, with its numpy reference
// implementation, in kiln/matmul_q4_1.py; this file implements it, with the records, the activation quantizer and
// the tile of q4_1_records.h (which kiln.MoE's Q4_1 experts share).
//
//   1. at session load, the constant weights are repacked once for this kernel (pack_weights): output
//      channels in groups of 16, each block of 32 inputs of a group one 320-byte record (the group's
//      nibbles four inputs a lane, then its 16 d and 16 m in float16). Weights that are not constant are
//      repacked on every call;
//   2. each activation row is quantized per block of 32 to int8 (step max|x| / 127, exact float sum and
//      what int8 loses of it);
//   3. work items (a chunk of channel groups x a chunk of rows) run on ONNX Runtime's intra-op thread pool;
//      a tile is one vector of channels x up to 12 rows. Lanes are output channels: a block's dot is 8 vpdpbusd
//      (16 channels x 4 inputs each, the row's 4 int8 broadcast) into int32, then scaled once per block:
//          y += d * (xs * dot + 7.5 * E) + m * S
//      A tile's accumulators are its outputs, so nothing is summed across lanes at the end.
//
// Output channels in lanes make the per-block float work one conversion and three FMAs per 16 channels and
// row, where inputs in lanes paid it per 8 inputs (docs/design.md, "kiln.MatMulQ4_1"). Every path
// sums a (channel, row) over the blocks in order with the same arithmetic, so a row's outputs are bitwise the same
// for every T and every tile (speculative verification reproduces decode's logits exactly), and the AVX2 build,
// which emulates vpdpbusd with maddubs + madd (the same int32 sums: a nibble times |x| <= 127, twice, fits
// int16), computes the same bits.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "matmul_q4_1.h"
#include "parallel_for.h"
#include "q4_1_records.h"
#include "shape_text.h"

namespace kiln {
namespace {

using namespace q4_1;  // NOLINT: the records, the activations and the tile (q4_1_records.h)

constexpr int64_t kPairBytes = 32;      // the op's qs: the nibbles of two blocks
constexpr int64_t kGroupsPerItem = 2;   // channel groups per work item (SmolLM2's N = 576 is 36 groups)
constexpr int64_t kRowsPerItem = 32;    // activation rows per work item
constexpr int64_t kParallelQuantize = 1 << 15;  // activation elements from which quantizing is parallel

[[noreturn]] void fail_q4(const std::string& msg) {
  throw Ort::Exception("kiln.MatMulQ4_1: " + msg, ORT_INVALID_ARGUMENT);
}

struct Shape {
  int64_t N = 0, nb = 0;
  int64_t groups() const { return (N + kGroup - 1) / kGroup; }
  int64_t group_bytes() const { return nb * kRecordBytes; }
};

// The op's qs [N, ceil(nb / 2), 32] and dm [N, 2, nb] as records [groups, nb, 320] (q4_1_records.h).
AlignedVector<uint8_t> pack_weights(const uint8_t* qs, const uint16_t* dm, const Shape& s) {
  AlignedVector<uint8_t> out(s.groups() * s.group_bytes(), 0);
  const int64_t pairs = (s.nb + 1) / 2;
  uint8_t q[kBlock];
  for (int64_t n = 0; n < s.N; ++n) {
    uint8_t* group = out.data() + (n / kGroup) * s.group_bytes();
    for (int64_t b = 0; b < s.nb; ++b) {
      const uint8_t* src = qs + (n * pairs + b / 2) * kPairBytes;
      const int shift = 4 * static_cast<int>(b % 2);
      for (int64_t i = 0; i < kBlock; ++i) q[i] = (src[i] >> shift) & 15;
      write_block(group, n % kGroup, b, q, dm[n * 2 * s.nb + b], dm[(n * 2 + 1) * s.nb + b]);
    }
  }
  return out;
}

// The op's contract on its weights' shapes (kiln/matmul_q4_1.py), for the constructor and for Compute's errors.
bool valid_dm(const std::vector<int64_t>& ds) { return ds.size() == 3 && ds[0] > 0 && ds[1] == 2 && ds[2] > 0; }
std::vector<int64_t> qs_shape(const std::vector<int64_t>& ds) { return {ds[0], (ds[2] + 1) / 2, kPairBytes}; }

struct MatMulQ4_1 {
  // Constant weights (every engine's) are repacked once, here; others on every call.
  MatMulQ4_1(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info{info};
    int qs_constant = 0, dm_constant = 0;
    const Ort::ConstValue qs = kernel_info.GetTensorConstantInput(1, &qs_constant);
    const Ort::ConstValue dm = kernel_info.GetTensorConstantInput(2, &dm_constant);
    if (!qs_constant || !dm_constant) return;
    const auto qs_info = qs.GetTensorTypeAndShapeInfo(), dm_info = dm.GetTensorTypeAndShapeInfo();
    if (qs_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ||
        dm_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
      return;  // Compute names the problem
    const std::vector<int64_t> qss = qs_info.GetShape(), ds = dm_info.GetShape();
    if (!valid_dm(ds) || qss != qs_shape(ds)) return;
    const uint8_t* nibbles = qs.GetTensorData<uint8_t>();
    const uint16_t* steps = reinterpret_cast<const uint16_t*>(dm.GetTensorData<Ort::Float16_t>());
    packed_ = pack_weights(nibbles, steps, Shape{ds[0], ds[2]});
    release_pages(nibbles, qs_info.GetElementCount());
    release_pages(steps, dm_info.GetElementCount() * sizeof(uint16_t));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<uint8_t>& qs, const Ort::Custom::Tensor<Ort::Float16_t>& dm,
                      std::optional<const Ort::Custom::Tensor<float>*> bias, Ort::Custom::Tensor<float>& y) {
    try {
      run(ctx, x, qs, dm, bias.value_or(nullptr), y);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.MatMulQ4_1: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& qs,
           const Ort::Custom::Tensor<Ort::Float16_t>& dm, const Ort::Custom::Tensor<float>* bias,
           Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t>& ds = dm.Shape();
    const std::vector<int64_t>& qss = qs.Shape();
    std::vector<int64_t> xs = x.Shape();
    if (!valid_dm(ds)) fail_q4("dm must be float16 [N, 2, nb] (rows d and m of each block), got " + shape_text(ds));
    const int64_t N = ds[0], nb = ds[2], K = nb * kBlock;
    if (qss != qs_shape(ds))
      fail_q4("qs must be uint8 [N, ceil(nb / 2), 32] = " + shape_text(qs_shape(ds)) + " for dm " + shape_text(ds) +
              ", got " + shape_text(qss));
    if (xs.empty() || xs.back() != K)
      fail_q4("x must be [..., K = " + std::to_string(K) + "] for dm " + shape_text(ds) + ", got " + shape_text(xs));
    if (bias != nullptr && bias->Shape() != std::vector<int64_t>{N})
      fail_q4("bias must be [N = " + std::to_string(N) + "], got " + shape_text(bias->Shape()));
    const int64_t T = x.NumberOfElement() / K;
    xs.back() = N;
    float* out = y.Allocate(xs);
    if (T == 0) return;

    AlignedVector<uint8_t> repacked;
    const Shape shape{N, nb};
    if (packed_.empty()) repacked = pack_weights(qs.Data(), reinterpret_cast<const uint16_t*>(dm.Data()), shape);
    const uint8_t* w = packed_.empty() ? repacked.data() : packed_.data();

    // Decode-sized rows reuse a scratch of the calling thread (allocations a call measured ~4% of a decode step:
    // docs/design.md, "kiln.MatMulQ4_1"); larger batches allocate their own, so the scratch stays
    // small. `rows` is a reference: the lambdas below run on the pool's threads too.
    thread_local Int8Rows scratch;
    Int8Rows local;
    Int8Rows& rows = T <= kRowsPerItem ? scratch : local;
    rows.reset(T, K, nb);
    const float* xd = x.Data();
    auto quantize = [&](size_t t) {
      quantize_row(xd + t * K, nb, rows.q.data() + t * K, rows.step.data() + t * nb, rows.sum.data() + t * nb,
                   rows.centred_error.data() + t * nb);
    };
    if (T * K >= kParallelQuantize) parallel_for(ctx, T, quantize);
    else for (int64_t t = 0; t < T; ++t) quantize(t);

    const Problem p{w, bias ? bias->Data() : nullptr, &rows, out, N, nb, shape.group_bytes()};
    const int64_t vectors = shape.groups() * kVectorsPerGroup;
    const int64_t vectors_per_item = kGroupsPerItem * kVectorsPerGroup;
    const int64_t channel_chunks = (vectors + vectors_per_item - 1) / vectors_per_item;
    const int64_t row_chunks = (T + kRowsPerItem - 1) / kRowsPerItem;
    auto item = [&](size_t i) {
      const int64_t c = static_cast<int64_t>(i) % channel_chunks, r = static_cast<int64_t>(i) / channel_chunks;
      run_item(p, c * vectors_per_item, std::min(vectors, (c + 1) * vectors_per_item), r * kRowsPerItem,
               std::min(T, (r + 1) * kRowsPerItem));
    };
    parallel_for(ctx, static_cast<size_t>(channel_chunks * row_chunks), item);
  }

  AlignedVector<uint8_t> packed_;  // the constant weights' records; empty: repacked per call
};

}  // namespace

void add_matmul_q4_1(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MatMulQ4_1>("MatMulQ4_1", "CPUExecutionProvider"));
}

}  // namespace kiln
