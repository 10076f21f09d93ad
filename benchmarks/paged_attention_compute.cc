// The CPU PagedAttention kernel's compute alone: one decode (1B shapes: 32 query / 8 KV heads of 64, 16-token
// blocks) run through run_item on the calling thread, timed in thread CPU time, best of `reps`, per cached
// position and layer. SAME=1 points every block-table entry at one block, so K/V stay in L1 and the figure is the
// kernel's instructions without memory waits; otherwise the blocks lie in random pool order.
//
//   g++ -std=c++17 -O3 -mavx2 -mfma -mf16c -I runtime/ops -I ~/.cache/kiln/ort-headers
//       benchmarks/paged_attention_compute.cc -o /tmp/pa_compute && SAME=1 /tmp/pa_compute 15
//
// Pointing -I at another copy of runtime/ops (e.g. a worktree at an older commit) times that kernel instead.
#define ORT_API_MANUAL_INIT
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "paged_attention_kernel.h"

using namespace kiln;

static double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

template <typename KvT>
KvT from_float(float x);
template <>
Ort::Float16_t from_float(float x) {
  Ort::Float16_t h;
  h.val = _cvtss_sh(x, 0);
  return h;
}
template <>
int8_t from_float(float x) {
  return static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x * 40))));
}

template <typename KvT>
double ns_per_position(int ctx, int reps, bool same_block) {
  const int H = 32, Hkv = 8, D = 64, bs = 16, blocks = (ctx + bs - 1) / bs;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0, 1);
  std::vector<KvT> pool(static_cast<size_t>(blocks) * 2 * Hkv * bs * D);
  for (auto& x : pool) x = from_float<KvT>(normal(gen));
  std::vector<int32_t> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = same_block ? 0 : i;
  if (!same_block) std::shuffle(table.begin(), table.end(), gen);
  std::vector<float> q(H * D), k(Hkv * D), v(Hkv * D), out(H * D);
  for (auto* x : {&q, &k, &v})
    for (float& f : *x) f = normal(gen);
  int32_t seq_lens[1] = {ctx}, qsl[2] = {0, 1};
  std::vector<float> steps(2 * Hkv, 1.f / 40);
  Problem<KvT> p{};
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.q_stride = H * D, p.kv_stride = Hkv * D;
  p.block_tables = table.data(), p.seq_lens = seq_lens, p.qsl = qsl, p.pool = pool.data(), p.out = out.data();
  p.kv_scale = is_int8<KvT>() ? steps.data() : nullptr;
  p.num_tokens = 1, p.H = H, p.Hkv = Hkv, p.D = D, p.G = H / Hkv, p.block_size = bs, p.max_blocks = blocks;
  p.scale = 0.125f;
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  plan(p, 1, /*serial=*/true, items, groups);  // one item per KV head, no partitions: nothing to merge
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    const double t0 = cpu_seconds();
    for (size_t i = 0; i < items.size(); ++i) run_item(p, items[i], i + 1 < items.size() ? &items[i + 1] : nullptr);
    best = std::min(best, cpu_seconds() - t0);
  }
  return best / ctx * 1e9;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  const bool same = std::getenv("SAME") != nullptr;
  for (int ctx : {1024, 8192, 32768})
    std::printf("context %6d: fp16 %.1f ns, int8 %.1f ns per cached position and layer%s\n", ctx,
                ns_per_position<Ort::Float16_t>(ctx, reps, same), ns_per_position<int8_t>(ctx, reps, same),
                same ? " (K/V of one block: in L1)" : "");
  return 0;
}
