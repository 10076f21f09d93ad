// kiln.MatMulQ4_1 (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract (inputs, weight layout, semantics) is written once, with its numpy reference
// implementation, in kiln/matmul_q4_1.py; this file implements it, with the records, the activation quantizer and
// the tile of q4_1_records.h (which kiln.MoE's Q4_1 experts share).
//
//   1. the weights as records: output channels in groups of 16, each block of 32 inputs of a group one 320-byte
//      record (the group's nibbles four inputs a lane, then its 16 d and 16 m in float16). An engine stores them so
//      (layout "records"): the kernel reads the tensor where ONNX Runtime has it, the engine file's mapped pages,
//      with no copy. Weights in blocks (layout "blocks": older engines, graphs before the build's last step) are
//      packed into records once, at session load, when constant (pack_weights), on every call otherwise;
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

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "amx_q4_1.h"
#include "matmul_q4_1.h"
#include "parallel_for.h"
#include "q4_1_records.h"
#include "shape_text.h"
#include "weight_layout.h"

namespace kiln {
namespace {

using namespace q4_1;  // NOLINT: the records, the activations and the tile (q4_1_records.h)

constexpr int64_t kPairBytes = 32;      // the op's qs: the nibbles of two blocks

[[noreturn]] void fail_q4(const std::string& msg) {
  throw Ort::Exception("kiln.MatMulQ4_1: " + msg, ORT_INVALID_ARGUMENT);
}

struct Shape {
  int64_t N = 0, nb = 0;
  int64_t groups() const { return (N + kGroup - 1) / kGroup; }
  int64_t group_bytes() const { return nb * kRecordBytes; }
};

// Packed records: 64-byte aligned (a record's chunks are whole cache lines), left uninitialised (pack_groups writes
// every byte). Buffers of 2 MiB and more are 2 MiB aligned and asked for huge pages: an 8B model's 4.5 GB of records
// faulted in 4 KiB pages cost its load ~1 s of page faults alone.
class PackedWeights {
 public:
  PackedWeights() = default;
  explicit PackedWeights(size_t size) {
    data_ = static_cast<uint8_t*>(::operator new(size, std::align_val_t(alignment(size))));
    size_ = size;
#ifdef MADV_HUGEPAGE
    if (alignment(size) == kHugePage) madvise(data_, size / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint
#endif
  }
  PackedWeights(PackedWeights&& other) noexcept { swap(other); }
  PackedWeights& operator=(PackedWeights&& other) noexcept {
    swap(other);
    return *this;
  }
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;
  ~PackedWeights() {
    if (data_) ::operator delete(data_, std::align_val_t(alignment(size_)));
  }
  bool empty() const { return data_ == nullptr; }
  uint8_t* data() const { return data_; }

 private:
  static constexpr size_t kHugePage = size_t{1} << 21;
  static size_t alignment(size_t size) { return size >= kHugePage ? kHugePage : 64; }
  void swap(PackedWeights& other) {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Channel n's block b (its 32 nibbles, the low or high halves of the op's 32-byte pair) as the 16 bytes of its lane:
// byte 4j + i = nibble 8j + i | nibble 8j + 4 + i << 4.
inline __m128i lane_bytes(const uint8_t* pair, int shift) {
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i v0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)),
                                                 _mm_cvtsi32_si128(shift)), mask);
  const __m128i v1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)),
                                                 _mm_cvtsi32_si128(shift)), mask);
  const __m128i lo = _mm_or_si128(
      _mm_shuffle_epi8(v0, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1)),
      _mm_shuffle_epi8(v1, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 2, 3, 8, 9, 10, 11)));
  const __m128i hi = _mm_or_si128(
      _mm_shuffle_epi8(v0, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)),
      _mm_shuffle_epi8(v1, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 4, 5, 6, 7, 12, 13, 14, 15)));
  return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));  // hi's bytes are < 16: nothing shifts across a byte
}

// The records of channel groups [g_begin, g_end), each written whole and in order; channels past N are zeros.
void pack_groups(const uint8_t* qs, const uint16_t* dm, const Shape& s, uint8_t* out, int64_t g_begin,
                 int64_t g_end) {
  const int64_t pairs = (s.nb + 1) / 2;
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t b = 0; b < s.nb; ++b) {
      uint8_t* rec = out + g * s.group_bytes() + b * kRecordBytes;
      uint16_t* steps = reinterpret_cast<uint16_t*>(rec + kStepsOffset);
      const int shift = 4 * static_cast<int>(b % 2);
      for (int64_t l = 0; l < kGroup; ++l) {
        const int64_t n = g * kGroup + l;
        const __m128i lane = n < s.N ? lane_bytes(qs + (n * pairs + b / 2) * kPairBytes, shift) : _mm_setzero_si128();
        for (int j = 0; j < kChunks; ++j) {
          const int32_t word = j == 0 ? _mm_extract_epi32(lane, 0) : j == 1 ? _mm_extract_epi32(lane, 1)
                               : j == 2 ? _mm_extract_epi32(lane, 2) : _mm_extract_epi32(lane, 3);
          std::memcpy(rec + j * kChunkBytes + 4 * l, &word, 4);
        }
        steps[l] = n < s.N ? dm[n * 2 * s.nb + b] : 0;
        steps[kGroup + l] = n < s.N ? dm[(n * 2 + 1) * s.nb + b] : 0;
      }
    }
}

// The op's qs [N, ceil(nb / 2), 32] and dm [N, 2, nb] as records [groups, nb, 320]: chunk j of block b holds, in
// lane l's 4 bytes, channel 16g + l's inputs 32b + 8j + i (low nibble) and 32b + 8j + 4 + i (high nibble), i = 0..3;
// then the group's 16 d and 16 m. Channels past N are zeros. A large matrix is packed on one thread per core (the
// session's load waits on it: an 8B model's 4.5 GB took ~4 s on one thread).
PackedWeights pack_weights(const uint8_t* qs, const uint16_t* dm, const Shape& s) {
  PackedWeights out(static_cast<size_t>(s.groups() * s.group_bytes()));
  constexpr int64_t kBytesPerThread = int64_t{8} << 20;
  const int64_t threads = std::min<int64_t>({std::max(1u, std::thread::hardware_concurrency()), s.groups(),
                                             std::max<int64_t>(1, s.groups() * s.group_bytes() / kBytesPerThread)});
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t)
    workers.emplace_back(pack_groups, qs, dm, std::cref(s), out.data(), s.groups() * t / threads,
                         s.groups() * (t + 1) / threads);
  pack_groups(qs, dm, s, out.data(), 0, s.groups() / threads);
  for (std::thread& worker : workers) worker.join();
  return out;
}

// The op's contract on its weights' shapes in either layout (kiln/matmul_q4_1.py), for the constructor and for
// Compute's errors.
using Layout = WeightLayout;

bool valid_dm(const std::vector<int64_t>& ds) { return ds.size() == 3 && ds[0] > 0 && ds[1] == 2 && ds[2] > 0; }
std::vector<int64_t> qs_shape(const std::vector<int64_t>& ds) { return {ds[0], (ds[2] + 1) / 2, kPairBytes}; }

Shape blocks_shape(const std::vector<int64_t>& qss, const std::vector<int64_t>& ds) {
  if (!valid_dm(ds)) fail_q4("dm must be float16 [N, 2, nb] (rows d and m of each block), got " + shape_text(ds));
  if (qss != qs_shape(ds))
    fail_q4("qs must be uint8 [N, ceil(nb / 2), 32] = " + shape_text(qs_shape(ds)) + " for dm " + shape_text(ds) +
            ", got " + shape_text(qss));
  return Shape{ds[0], ds[2]};
}

Shape records_shape(const std::vector<int64_t>& qss, const std::vector<int64_t>& ds) {
  if (ds.size() != 2 || ds[0] <= 0 || ds[1] != 0)
    fail_q4("dm must be float16 [N, 0] with layout \"records\" (no numbers: its shape names N), got " +
            shape_text(ds));
  const Shape s{ds[0], qss.size() == 3 ? qss[1] : 0};
  if (qss.size() != 3 || qss[0] != s.groups() || qss[1] <= 0 || qss[2] != kRecordBytes)
    fail_q4("qs must be uint8 records [ceil(N / 16) = " + std::to_string(s.groups()) + ", nb, " +
            std::to_string(kRecordBytes) + "] for dm " + shape_text(ds) + ", got " + shape_text(qss));
  return s;
}

// The layout attribute; absent in engines of op-library ABI < 9, whose weights are blocks.
Layout read_layout(const Ort::ConstKernelInfo& info) {
  std::string name;
  if (const std::optional<Layout> layout = read_weight_layout(info, name)) return *layout;
  fail_q4("layout must be \"blocks\" or \"records\", got \"" + name + "\"");
}

struct MatMulQ4_1 {
  // Records are read in place on every call. Constant blocks (older engines) are packed once, here; others on every
  // call.
  MatMulQ4_1(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info{info};
    layout_ = read_layout(kernel_info);
    centre_ = read_centre(kernel_info, kCentre, fail_q4);  // absent in engines of op-library ABI < 15
    if (layout_ == Layout::kRecords) return;
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
    const Shape shape = layout_ == Layout::kRecords ? records_shape(qss, ds) : blocks_shape(qss, ds);
    const int64_t N = shape.N, nb = shape.nb, K = nb * kBlock;
    if (xs.empty() || xs.back() != K)
      fail_q4("x must be [..., K = " + std::to_string(K) + "] for qs " + shape_text(qss) + ", got " + shape_text(xs));
    if (bias != nullptr && bias->Shape() != std::vector<int64_t>{N})
      fail_q4("bias must be [N = " + std::to_string(N) + "], got " + shape_text(bias->Shape()));
    const int64_t T = x.NumberOfElement() / K;
    xs.back() = N;
    float* out = y.Allocate(xs);
    if (T == 0) return;

    PackedWeights repacked;
    const bool pack_now = layout_ == Layout::kBlocks && packed_.empty();
    if (pack_now) repacked = pack_weights(qs.Data(), reinterpret_cast<const uint16_t*>(dm.Data()), shape);
    const uint8_t* w = layout_ == Layout::kRecords ? qs.Data() : pack_now ? repacked.data() : packed_.data();

    // Calls of 32 rows and more run on AMX tiles where the CPU and Linux allow (amx_q4_1.h), the rest on the
    // vpdpbusd tile; both give the same bits.
    const float* b = bias ? bias->Data() : nullptr;
    if (!amx::try_multiply(ctx, w, shape.group_bytes(), x.Data(), b, out, T, N, K, centre_))
      multiply<Q4_1Format>(ctx, w, shape.group_bytes(), x.Data(), b, out, T, N, K, centre_);
  }

  Layout layout_ = Layout::kBlocks;
  float centre_ = kCentre;
  PackedWeights packed_;  // constant blocks' records; empty: records read in place, or blocks packed per call
};

}  // namespace

void add_matmul_q4_1(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<MatMulQ4_1>("MatMulQ4_1", "CPUExecutionProvider"));
}

}  // namespace kiln

// kiln.MatMulQ4_1 calls this process ran on AMX (amx_q4_1.h): 0 where the CPU, Linux or $KILN_OPS_ISA rule it out.
extern "C" __attribute__((visibility("default"))) int64_t kiln_amx_multiplies() {
  return kiln::amx::multiplies().load(std::memory_order_relaxed);
}
