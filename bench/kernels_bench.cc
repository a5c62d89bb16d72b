// CPU kernel throughput: paged-attention decode at context 128 and 1024, and
// linear (OpenBLAS sgemm) at a few Llama-like sizes.
//
//   bazel run -c opt //bench:kernels_bench
//
// Attention decode: 8 one-token requests, 32 query heads, 8 kv heads,
// head_dim 128, block size 16, shuffled block tables; bytes_per_second counts
// the K and V bytes read. Linear: GFLOP/s counter = 2·T·in·out per call.
// OpenBLAS uses its default thread count (OPENBLAS_NUM_THREADS to pin it),
// so rates are per wall-clock second (UseRealTime).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/paged_attention.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {
namespace {

struct Env {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Arena> arena;
};

Env MakeEnv(size_t arena_bytes) {
  Env env;
  DeviceOptions options;
  options.cpu.memory_init = CpuMemoryInit::kUninitialized;
  auto device = CreateDevice(DeviceKind::kCpu, options);
  if (!device.ok()) std::abort();
  env.device = *std::move(device);
  auto stream = env.device->CreateStream();
  ArenaOptions arena_options;
  arena_options.capacity_bytes = arena_bytes;
  auto arena = Arena::Create(*env.device, arena_options);
  if (!stream.ok() || !arena.ok()) std::abort();
  env.stream = *std::move(stream);
  env.arena = *std::move(arena);
  return env;
}

DeviceBuffer Fill(Env& env, std::vector<float> values) {
  auto buffer = env.arena->Allocate(values.size() * sizeof(float));
  if (!buffer.ok()) std::abort();
  if (!env.stream->CopyToDevice(*buffer, values.data(), buffer->size_bytes())
           .ok()) {
    std::abort();
  }
  return *buffer;
}

DeviceBuffer FillInts(Env& env, const std::vector<int32_t>& values) {
  auto buffer = env.arena->Allocate(values.size() * sizeof(int32_t));
  if (!buffer.ok()) std::abort();
  if (!env.stream->CopyToDevice(*buffer, values.data(), buffer->size_bytes())
           .ok()) {
    std::abort();
  }
  return *buffer;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

void BM_AttentionDecode(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  constexpr int kReqs = 8, kHeads = 32, kKvHeads = 8, kHeadDim = 128;
  constexpr int kBlockSize = 16;
  const int blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  const int num_blocks = kReqs * blocks_per_seq;
  const size_t cache_elements =
      static_cast<size_t>(num_blocks) * kBlockSize * kKvHeads * kHeadDim;
  Env env = MakeEnv(2 * cache_elements * sizeof(float) + (size_t{8} << 20));

  std::vector<int32_t> blocks(num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(1));
  PagedAttentionParams p;
  p.seq_lens = FillInts(env, std::vector<int32_t>(kReqs, context));
  p.block_tables = FillInts(env, blocks);
  p.query = Fill(env, Random(kReqs * kHeads * kHeadDim, 2));
  p.key_cache = Fill(env, Random(cache_elements, 3));
  p.value_cache = Fill(env, Random(cache_elements, 4));
  p.output = Fill(env, std::vector<float>(kReqs * kHeads * kHeadDim));
  p.num_tokens = kReqs;
  p.max_num_seqs = kReqs;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.block_size = kBlockSize;
  p.num_blocks = num_blocks;
  p.max_blocks_per_seq = blocks_per_seq;
  p.uniform_query_len = 1;
  for (auto _ : state) {
    if (!LaunchPagedAttentionUniformDecode(*env.stream, p).ok()) {
      state.SkipWithError("launch failed");
      break;
    }
    benchmark::DoNotOptimize(p.output.data());
  }
  const int64_t kv_bytes = int64_t{2} * kReqs * context * kKvHeads * kHeadDim *
                           static_cast<int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * kv_bytes);
  state.SetItemsProcessed(state.iterations() * kReqs);  // tokens
}
BENCHMARK(BM_AttentionDecode)
    ->ArgName("context")
    ->Arg(128)
    ->Arg(1024)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_Linear(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const int in = static_cast<int>(state.range(1));
  const int out = static_cast<int>(state.range(2));
  Env env = MakeEnv((static_cast<size_t>(tokens) * (in + out) +
                     static_cast<size_t>(in) * out + out) *
                        sizeof(float) +
                    (size_t{4} << 20));
  LinearParams p;
  p.input = Fill(env, Random(static_cast<size_t>(tokens) * in, 5));
  p.weight = Fill(env, Random(static_cast<size_t>(out) * in, 6));
  p.bias = Fill(env, Random(out, 7));
  p.output = Fill(env, std::vector<float>(static_cast<size_t>(tokens) * out));
  p.num_tokens = tokens;
  p.in_features = in;
  p.out_features = out;
  for (auto _ : state) {
    if (!LaunchLinear(*env.stream, p).ok()) {
      state.SkipWithError("launch failed");
      break;
    }
    benchmark::DoNotOptimize(p.output.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(
      2.0 * tokens * in * out * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Linear)
    ->ArgNames({"tokens", "in", "out"})
    ->Args({1, 2048, 2048})
    ->Args({8, 2048, 2048})
    ->Args({64, 2048, 2048})
    ->Args({256, 2048, 5632})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kernels
}  // namespace pdworker
