// Micro-benchmarks for the per-step dispatcher path:
//  - CudagraphDispatcher::Dispatch() for 8, 67 and 512 capture sizes, to show
//    its cost does not depend on how many graphs were captured;
//  - GraphStats::Record() from 1, 2 and 4 threads, against a single-mutex
//    baseline.
// Results and the exact command are in bench/RESULTS.md.
#include <cstdint>
#include <mutex>
#include <random>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "benchmark/benchmark.h"
#include "dispatcher/capture_sizes.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/graph_stats.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

// Capture lists of the requested length: powers of two for 8, the vLLM rule
// up to 768 for 67, every even size up to 1024 for 512.
std::vector<int> CaptureSizes(int count) {
  std::vector<int> sizes;
  switch (count) {
    case 8:
      for (int s = 1; s <= 128; s *= 2) sizes.push_back(s);
      break;
    case 67:
      sizes = VllmCaptureSizesUpTo(768);
      break;
    case 512:
      for (int s = 2; s <= 1024; s += 2) sizes.push_back(s);
      break;
  }
  CHECK_EQ(static_cast<int>(sizes.size()), count);
  return sizes;
}

struct Batch {
  int num_tokens;
  BatchKind kind;
};

// Random batches within (and slightly above) the captured range, so the
// table loads and branches see realistic, unpredictable inputs.
std::vector<Batch> RandomBatches(int max_size) {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> tokens(1, max_size + max_size / 16);
  std::vector<Batch> batches(4096);
  for (Batch& b : batches) {
    b.num_tokens = tokens(rng);
    b.kind = (rng() & 1) ? BatchKind::kUniformDecode : BatchKind::kMixed;
  }
  return batches;
}

void BM_Dispatch(benchmark::State& state) {
  const std::vector<int> sizes = CaptureSizes(static_cast<int>(state.range(0)));
  CudagraphDispatcher dispatcher;
  CHECK(dispatcher
            .Initialize(CudaGraphMode::FullAndPiecewise(), sizes,
                        /*max_num_seqs=*/1024, /*uniform_decode_query_len=*/1)
            .ok());
  const std::vector<Batch> batches = RandomBatches(sizes.back());
  size_t i = 0;
  for (auto _ : state) {
    const Batch& b = batches[i++ & (batches.size() - 1)];
    DispatchResult r = dispatcher.Dispatch(b.num_tokens, b.kind);
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Dispatch)->Arg(8)->Arg(67)->Arg(512);

// Baseline for GraphStats: the obvious single mutex around one map, to show
// what sharding buys when several threads record.
class SingleMutexStats {
 public:
  void Record(int unpadded, int padded, RuntimeMode mode) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[std::make_tuple(unpadded, padded, mode)];
  }

 private:
  std::mutex mu_;
  absl::flat_hash_map<std::tuple<int, int, RuntimeMode>, int64_t> counts_
      ABSL_GUARDED_BY(mu_);
};

// One stats object shared by all threads of a run (set up and torn down by
// thread 0; Google Benchmark puts barriers around the timed loop). ~100
// distinct keys, as a worker sees after warm-up.
template <typename Stats>
Stats* shared_stats = nullptr;

template <typename Stats>
void BM_Record(benchmark::State& state) {
  if (state.thread_index() == 0) shared_stats<Stats> = new Stats();
  std::mt19937 rng(7 + state.thread_index());
  std::vector<int> unpadded(1024);
  for (int& u : unpadded) u = 1 + static_cast<int>(rng() % 100);
  size_t i = 0;
  for (auto _ : state) {
    const int u = unpadded[i++ & 1023];
    shared_stats<Stats>->Record(u, (u + 7) & ~7, RuntimeMode::kFull);
  }
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    delete shared_stats<Stats>;
    shared_stats<Stats> = nullptr;
  }
}
// Real time, so items_per_second is the aggregate throughput of all threads.
BENCHMARK_TEMPLATE(BM_Record, GraphStats)
    ->Threads(1)
    ->Threads(2)
    ->Threads(4)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Record, SingleMutexStats)
    ->Threads(1)
    ->Threads(2)
    ->Threads(4)
    ->UseRealTime();

}  // namespace
}  // namespace pdworker
