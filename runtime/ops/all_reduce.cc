// kiln.AllReduce (domain "kiln", version 1): the ONNX Runtime CPU kernel.
//
// The contract and the workspace layout are written once, with the numpy reference, in kiln/all_reduce.py:
// y = sum over ranks of their x, added in rank order in float32 (bit for bit the same on every rank), through a
// shared-memory workspace the ranks' processes map and the runtime binds to the input tp_workspace.
//
// One barrier per call, two buffers: call g writes buffer g % 2 (a rank reaches call g + 2, which writes it again,
// only after every rank has published g + 1 and so has finished reading call g). The wait spins briefly (ranks
// pinned to their own cores arrive within microseconds), then yields, then sleeps in short naps, and fails rather
// than hangs: on the abort word, on a peer whose pid is gone, or after timeout_ms. A failure sets the abort word so
// that every other rank's wait fails too.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "all_reduce.h"
#include "shape_text.h"

namespace kiln {
namespace {

// kiln/all_reduce.py's layout
constexpr uint64_t kMagic = 0x6B696C6E41525331ull;
constexpr uint64_t kLayoutVersion = 1;
constexpr int64_t kLine = 64, kWords = kLine / 8, kPage = 4096;
enum Header { kMagicWord, kVersion, kWorld, kTimeoutMs, kAbort, kSlotBytes };
enum Stats { kPid, kWaitNs, kBytes, kCalls };
// a published line's words: the call number, then the element count of the call in each buffer
enum Published { kCall, kElements0, kElements1 };

constexpr int kSpins = 2000;            // pause loops before yielding (a few microseconds)
constexpr int64_t kYieldNs = 200000;    // then sched_yield for up to 0.2 ms, then naps
constexpr int64_t kNapNs = 20000;
constexpr int64_t kCheckEveryNs = 2000000;  // the abort word, peers' pids and the clock, every 2 ms

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t load(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
void store(uint64_t* word, uint64_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }

struct AllReduce {
  AllReduce(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    rank_ = ki.GetAttribute<int64_t>("rank");
    world_ = ki.GetAttribute<int64_t>("world_size");
    if (world_ < 1 || rank_ < 0 || rank_ >= world_)
      throw Ort::Exception("kiln.AllReduce: rank " + std::to_string(rank_) + " is not in [0, world_size " +
                               std::to_string(world_) + ")", ORT_INVALID_ARGUMENT);
  }

  Ort::Status Compute(const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& workspace,
                      Ort::Custom::Tensor<float>& y) {
    try {
      run(x, workspace, y);
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode());
    } catch (const std::exception& e) {
      return Ort::Status((std::string("kiln.AllReduce: ") + e.what()).c_str(), ORT_FAIL);
    }
    return Ort::Status{nullptr};
  }

 private:
  uint64_t* line(uint64_t* words, int64_t index) const { return words + index * kWords; }

  void run(const Ort::Custom::Tensor<float>& x, const Ort::Custom::Tensor<uint8_t>& workspace,
           Ort::Custom::Tensor<float>& y) {
    // the runtime's shared segment: written through, as kiln.PagedAttention writes its pool
    uint8_t* base = const_cast<uint8_t*>(workspace.Data());
    const int64_t size = workspace.NumberOfElement();
    const int64_t header = (kLine * (1 + 2 * world_) + kPage - 1) / kPage * kPage;
    if (size < header)
      throw Ort::Exception("kiln.AllReduce: the workspace (" + std::to_string(size) + " bytes) is smaller than its "
                           "header for " + std::to_string(world_) + " ranks", ORT_INVALID_ARGUMENT);
    uint64_t* words = reinterpret_cast<uint64_t*>(base);
    if (words[kMagicWord] != kMagic || words[kVersion] != kLayoutVersion ||
        static_cast<int64_t>(words[kWorld]) != world_)
      throw Ort::Exception("kiln.AllReduce: the workspace is not initialised for a group of " +
                           std::to_string(world_) + " ranks (kiln/all_reduce.py init_workspace)", ORT_INVALID_ARGUMENT);
    const int64_t slot = static_cast<int64_t>(words[kSlotBytes]);
    const std::vector<int64_t> shape = x.Shape();
    const int64_t n = x.NumberOfElement();
    float* out = y.Allocate(shape);
    if (n * 4 > slot)
      throw Ort::Exception("kiln.AllReduce: x " + shape_text(shape) + " (" + std::to_string(n * 4) +
                           " bytes) is larger than the workspace's slots (" + std::to_string(slot) + " bytes)",
                           ORT_INVALID_ARGUMENT);
    uint64_t* stats = line(words, 1 + world_ + rank_);
    uint64_t* mine = line(words, 1 + rank_);
    if (load(&words[kAbort])) fail(words, "the group was aborted before this call (a rank failed or its process died)");
    const uint64_t call = stats[kCalls] + 1;
    const int buffer = static_cast<int>(call % 2);
    auto slot_of = [&](int64_t r) {
      return reinterpret_cast<float*>(base + header + (buffer * world_ + r) * slot);
    };
    if (n) std::memcpy(slot_of(rank_), x.Data(), n * 4);
    stats[kPid] = static_cast<uint64_t>(getpid());
    mine[kElements0 + buffer] = static_cast<uint64_t>(n);
    store(&mine[kCall], call);
    stats[kCalls] = call;
    const int64_t start = now_ns();
    wait_for_all(words, call, start);
    stats[kWaitNs] += static_cast<uint64_t>(now_ns() - start);
    for (int64_t r = 0; r < world_; ++r) {
      const uint64_t theirs = line(words, 1 + r)[kElements0 + buffer];
      if (static_cast<int64_t>(theirs) != n)
        fail(words, "rank " + std::to_string(r) + " reduced " + std::to_string(theirs) + " elements in call " +
                        std::to_string(call) + ", this rank " + std::to_string(n) +
                        " (the ranks' graphs do not match)");
    }
    if (!n) return;
    std::memcpy(out, slot_of(0), n * 4);
    for (int64_t r = 1; r < world_; ++r) {  // rank order: the same float32 sums on every rank
      const float* part = slot_of(r);
      for (int64_t i = 0; i < n; ++i) out[i] += part[i];
    }
    stats[kBytes] += static_cast<uint64_t>(n * 4);
  }

  void wait_for_all(uint64_t* words, uint64_t call, int64_t start) {
    const int64_t timeout_ns = static_cast<int64_t>(words[kTimeoutMs]) * 1000000;
    int64_t next_check = start + kCheckEveryNs;
    for (int64_t spin = 0;; ++spin) {
      int64_t missing = -1;
      for (int64_t r = 0; r < world_ && missing < 0; ++r)
        if (load(&line(words, 1 + r)[kCall]) < call) missing = r;
      if (missing < 0) return;
      if (spin < kSpins) {
        _mm_pause();
        continue;
      }
      const int64_t now = now_ns();
      if (now >= next_check) {
        next_check = now + kCheckEveryNs;
        check_group(words, call, now - start, timeout_ns);
      }
      if (now - start < kYieldNs) {
        sched_yield();
      } else {
        const timespec nap{0, kNapNs};
        nanosleep(&nap, nullptr);
      }
    }
  }

  // Fails when the group cannot complete this call: aborted, a peer's process gone, or the timeout passed.
  void check_group(uint64_t* words, uint64_t call, int64_t waited_ns, int64_t timeout_ns) {
    if (load(&words[kAbort])) fail(words, "the group was aborted while this rank waited (a rank failed or its "
                                          "process died)");
    std::string late;
    for (int64_t r = 0; r < world_; ++r) {
      if (load(&line(words, 1 + r)[kCall]) >= call) continue;
      const pid_t pid = static_cast<pid_t>(load(&line(words, 1 + world_ + r)[kPid]));
      if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
        fail(words, "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") has exited");
      late += (late.empty() ? "" : ", ") + std::to_string(r);
    }
    if (waited_ns >= timeout_ns)
      fail(words, "rank " + std::to_string(rank_) + " waited " + std::to_string(waited_ns / 1000000) +
                      " ms for rank(s) " + late + " in call " + std::to_string(call) + " (timeout " +
                      std::to_string(timeout_ns / 1000000) + " ms)");
  }

  [[noreturn]] void fail(uint64_t* words, const std::string& why) {
    store(&words[kAbort], 1);  // every other rank's wait fails too: the group is done
    throw Ort::Exception("kiln.AllReduce: " + why, ORT_FAIL);
  }

  int64_t rank_ = 0, world_ = 1;
};

}  // namespace

void add_all_reduce(Ort::CustomOpDomain& domain) {
  domain.Add(Ort::Custom::CreateLiteCustomOp<AllReduce>("AllReduce", "CPUExecutionProvider"));
}

}  // namespace kiln
