// Prefill attention throughput (issue 22): one fresh prompt of N tokens
// attending causally to itself through the paged KV cache (block size 16,
// blocks in random order), 32 query heads over 8 kv heads (Llama-3.2-1B at
// head_dim 64, Llama-3-8B's layout at 128), for the tensor-core kernel
// (mma.sync), on compute capability 9.0 devices the warpgroup-MMA kernel
// (wgmma, with the largest difference of its outputs from the mma.sync
// kernel's), and the CUDA-core kernel. Prints a Markdown table; --jsonl appends
// one bench/results/gpu.jsonl record per figure (metric attention_tflops).
//
// FLOPs of causal attention: 4 · heads · head_dim · N(N+1)/2 (Q·Kᵀ and P·V,
// 2 per multiply-add, each query token attending to itself and every
// earlier one). Kernel time: median of 5 replays of a graph of
// back-to-back launches, timed with events (no launch overhead).
// bench/torch_compare/sdpa_bench.py times PyTorch's SDPA on the same shapes.
//
//   bazel build --config=opt //bench:prefill_attention_bench
//   bazel-bin/bench/prefill_attention_bench [--tokens=1024,...]
//       [--head_dims=64,128] [--cuda_cores_max_tokens=4096] [--nowgmma]
//       [--jsonl=FILE --commit=SHA]
// Without a usable GPU it prints why and exits 0.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "bench/gpu_bench_util.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/kernels/paged_attention.h"
#include "worker/model/float16.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(std::vector<std::string>, tokens,
          (std::vector<std::string>{"1024", "2048", "4096", "8192", "16384"}),
          "Prompt lengths (tokens).");
ABSL_FLAG(std::vector<std::string>, head_dims,
          (std::vector<std::string>{"64", "128"}), "Head dims.");
ABSL_FLAG(int, cuda_cores_max_tokens, 4096,
          "Longest prompt the CUDA-core kernel is timed at (it is ~50x "
          "slower).");
ABSL_FLAG(bool, wgmma, true,
          "Also time the warpgroup-MMA kernel (compute capability 9.0 "
          "devices only).");
ABSL_FLAG(std::string, jsonl, "", "Append gpu.jsonl records to this file.");
ABSL_FLAG(std::string, commit, "", "Commit the binary was built from.");

namespace pdworker {
namespace {

constexpr int kHeads = 32, kKvHeads = 8, kBlockSize = 16;

// The warpgroup-MMA kernel's configurations: key tile width × schedule.
struct WgmmaConfig {
  int tile_keys;
  kernels::WgmmaSchedule schedule;
  const char* name;    // table column
  const char* system;  // gpu.jsonl
};
constexpr int kNumWgmmaConfigs = 4;
constexpr WgmmaConfig kWgmmaConfigs[kNumWgmmaConfigs] = {
    {64, kernels::WgmmaSchedule::kSerial, "wgmma k64 serial",
     "pdworker_wgmma_k64_serial"},
    {64, kernels::WgmmaSchedule::kOverlapped, "wgmma k64 overlapped",
     "pdworker_wgmma_k64_overlap"},
    {128, kernels::WgmmaSchedule::kSerial, "wgmma k128 serial",
     "pdworker_wgmma_k128_serial"},
    {128, kernels::WgmmaSchedule::kOverlapped, "wgmma k128 overlapped",
     "pdworker_wgmma_k128_overlap"},
};

struct Row {
  int head_dim;
  int tokens;
  double mma_us = 0;         // tensor cores, 16 query rows per warp
  double mma32_us = 0;       // tensor cores, 32 rows per warp
  double cuda_cores_us = 0;  // 0: not run
  // Warpgroup MMA (sm_90a) in each configuration of kWgmmaConfigs; 0: not
  // run (another device) or failed. max_diff: the largest |output - the
  // 16-row mma.sync kernel's output| over all of them (a correctness check
  // beside the tests).
  double wgmma_us[kNumWgmmaConfigs] = {};
  double wgmma_max_diff = 0;
  double flops = 0;
};

Row Measure(Device& device, Stream& stream, int head_dim, int tokens,
            bool with_cuda_cores) {
  const int blocks = (tokens + kBlockSize - 1) / kBlockSize;
  const size_t kv_elems =
      static_cast<size_t>(blocks) * kBlockSize * kKvHeads * head_dim;
  const size_t q_elems = static_cast<size_t>(tokens) * kHeads * head_dim;
  ArenaOptions options;
  options.capacity_bytes = 2 * (2 * kv_elems + 2 * q_elems) +
                           sizeof(int32_t) * (blocks + 8) + (1 << 20);
  options.name = "prefill_attention_bench";
  auto arena = Arena::Create(device, options);
  CHECK(arena.ok()) << arena.status();
  auto alloc = [&](size_t bytes) {
    auto b = (*arena)->Allocate(bytes);
    CHECK(b.ok()) << b.status();
    return *b;
  };
  kernels::PagedAttentionParams p;
  p.num_reqs = alloc(sizeof(int32_t));
  p.query_start_loc = alloc(2 * sizeof(int32_t));
  p.seq_lens = alloc(sizeof(int32_t));
  p.block_tables = alloc(sizeof(int32_t) * blocks);
  p.query = alloc(2 * q_elems);
  p.key_cache = alloc(2 * kv_elems);
  p.value_cache = alloc(2 * kv_elems);
  p.output = alloc(2 * q_elems);
  p.num_tokens = tokens;
  p.max_num_seqs = 1;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = head_dim;
  p.block_size = kBlockSize;
  p.num_blocks = blocks;
  p.max_blocks_per_seq = blocks;
  p.dtype = DType::kBFloat16;

  std::mt19937 rng(7);
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int32_t one = 1, qsl[2] = {0, tokens};
  CHECK(stream.CopyToDevice(p.num_reqs, &one, 4).ok());
  CHECK(stream.CopyToDevice(p.query_start_loc, qsl, 8).ok());
  CHECK(stream.CopyToDevice(p.seq_lens, &tokens, 4).ok());
  CHECK(stream.CopyToDevice(p.block_tables, table.data(), 4 * blocks).ok());
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> host(std::max(kv_elems, q_elems));
  for (auto& v : host) v = FloatToBFloat16Bits(dist(rng));
  CHECK(stream.CopyToDevice(p.key_cache, host.data(), 2 * kv_elems).ok());
  std::shuffle(host.begin(), host.end(), rng);
  CHECK(stream.CopyToDevice(p.value_cache, host.data(), 2 * kv_elems).ok());
  std::shuffle(host.begin(), host.end(), rng);
  CHECK(stream.CopyToDevice(p.query, host.data(), 2 * q_elems).ok());

  auto time_us = [&](kernels::VarlenAttentionKernel kernel, int launches,
                     int warp_rows) {
    p.varlen_kernel = kernel;
    p.mma_warp_rows = warp_rows;
    return GraphReplayMicros(
        device, stream,
        [&] { return kernels::LaunchPagedAttention(stream, p); }, launches);
  };
  Row row;
  row.head_dim = head_dim;
  row.tokens = tokens;
  row.flops = 4.0 * kHeads * head_dim *
              (static_cast<double>(tokens) * (tokens + 1) / 2.0);
  const int launches = tokens >= 8192 ? 5 : 20;
  row.mma_us =
      time_us(kernels::VarlenAttentionKernel::kTensorCores, launches, 16);
  {
    row.mma32_us =
        time_us(kernels::VarlenAttentionKernel::kTensorCores, launches, 32);
  }
  if (with_cuda_cores) {
    row.cuda_cores_us =
        time_us(kernels::VarlenAttentionKernel::kCudaCores, 2, 0);
  }
  if (absl::GetFlag(FLAGS_wgmma) &&
      kernels::PagedAttentionHasWarpgroupMma(stream.kind())) {
    // One eager launch of each kernel, read back: the wgmma outputs against
    // the 16-row mma.sync kernel's. A launch error skips the timing.
    auto output = [&](kernels::VarlenAttentionKernel kernel,
                      std::vector<float>* out) {
      p.varlen_kernel = kernel;
      p.mma_warp_rows = 16;
      std::vector<uint16_t> bits(q_elems);
      absl::Status status = kernels::LaunchPagedAttention(stream, p);
      if (status.ok()) {
        status = stream.CopyToHost(bits.data(), p.output, 2 * q_elems);
      }
      out->resize(q_elems);
      for (size_t i = 0; i < q_elems; ++i) {
        (*out)[i] = BFloat16BitsToFloat(bits[i]);
      }
      return status;
    };
    std::vector<float> want, got;
    CHECK(output(kernels::VarlenAttentionKernel::kTensorCores, &want).ok());
    for (int c = 0; c < kNumWgmmaConfigs; ++c) {
      const WgmmaConfig& config = kWgmmaConfigs[c];
      p.wgmma_tile_keys = config.tile_keys;
      p.wgmma_schedule = config.schedule;
      const absl::Status status =
          output(kernels::VarlenAttentionKernel::kWarpgroupMma, &got);
      if (!status.ok()) {
        std::printf("%s, head_dim %d, %d tokens: %s\n", config.name, head_dim,
                    tokens, status.ToString().c_str());
        row.wgmma_max_diff = HUGE_VAL;
        continue;
      }
      for (size_t i = 0; i < q_elems; ++i) {
        const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
        // NaN counts as the worst difference.
        row.wgmma_max_diff =
            diff == diff ? std::max(row.wgmma_max_diff, diff) : HUGE_VAL;
      }
      row.wgmma_us[c] =
          time_us(kernels::VarlenAttentionKernel::kWarpgroupMma, launches, 0);
    }
    p.wgmma_tile_keys = 0;
    p.wgmma_schedule = kernels::WgmmaSchedule::kDefault;
  }
  return row;
}

std::vector<int> ParseInts(const std::vector<std::string>& items) {
  std::vector<int> out;
  for (const std::string& s : items) {
    int v = 0;
    CHECK(absl::SimpleAtoi(s, &v) && v > 0) << "not a positive integer: " << s;
    out.push_back(v);
  }
  return out;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  std::optional<BenchGpu> bench_gpu = OpenBenchGpu("prefill_attention_bench");
  if (!bench_gpu) return 0;
  Device& device = *bench_gpu->device;
  Stream& stream = *bench_gpu->stream;
  const std::string gpu = device.name();
  const int cuda_cores_max = absl::GetFlag(FLAGS_cuda_cores_max_tokens);
  std::vector<Row> rows;
  for (const int d : ParseInts(absl::GetFlag(FLAGS_head_dims))) {
    for (const int n : ParseInts(absl::GetFlag(FLAGS_tokens))) {
      rows.push_back(Measure(device, stream, d, n, n <= cuda_cores_max));
    }
  }
  std::printf(
      "device: %s; %d heads over %d kv heads, block size %d, one causal "
      "prompt\n\n",
      gpu.c_str(), kHeads, kKvHeads, kBlockSize);
  std::printf(
      "| head_dim | tokens | tensor cores (16 rows/warp) µs | TFLOP/s | "
      "tensor cores (32 rows/warp) µs | TFLOP/s | CUDA cores µs | TFLOP/s | "
      "speed-up |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: |\n");
  const bool wgmma = std::any_of(rows.begin(), rows.end(), [](const Row& r) {
    return std::any_of(std::begin(r.wgmma_us), std::end(r.wgmma_us),
                       [](double us) { return us > 0; });
  });
  if (wgmma) {
    std::printf("| head_dim | tokens |");
    for (const WgmmaConfig& config : kWgmmaConfigs) {
      std::printf(" %s µs | TFLOP/s |", config.name);
    }
    std::printf(
        " max abs diff vs mma.sync | best wgmma / best mma.sync |\n| ---: | "
        "---: |");
    for (int c = 0; c < kNumWgmmaConfigs; ++c) std::printf(" ---: | ---: |");
    std::printf(" ---: | ---: |\n");
    for (const Row& r : rows) {
      const double mma =
          r.mma32_us > 0 ? std::min(r.mma_us, r.mma32_us) : r.mma_us;
      std::printf("| %d | %d |", r.head_dim, r.tokens);
      double best = 0;
      for (const double us : r.wgmma_us) {
        if (us > 0) {
          std::printf(" %.1f | %.1f |", us, r.flops / us / 1e6);
          best = best > 0 ? std::min(best, us) : us;
        } else {
          std::printf(" failed | |");
        }
      }
      std::printf(" %.4g |", r.wgmma_max_diff);
      if (best > 0) {
        std::printf(" %.2fx |\n", mma / best);
      } else {
        std::printf(" |\n");
      }
    }
    std::printf("\n");
  } else {
    std::printf(
        "(warpgroup MMA not timed: the device is not compute capability "
        "9.0)\n\n");
  }
  for (const Row& r : rows) {
    std::printf("| %d | %d | %.1f | %.1f |", r.head_dim, r.tokens, r.mma_us,
                r.flops / r.mma_us / 1e6);
    if (r.mma32_us > 0) {
      std::printf(" %.1f | %.1f |", r.mma32_us, r.flops / r.mma32_us / 1e6);
    } else {
      std::printf(" | |");
    }
    const double best =
        r.mma32_us > 0 ? std::min(r.mma_us, r.mma32_us) : r.mma_us;
    if (r.cuda_cores_us > 0) {
      std::printf(" %.1f | %.1f | %.1fx |\n", r.cuda_cores_us,
                  r.flops / r.cuda_cores_us / 1e6, r.cuda_cores_us / best);
    } else {
      std::printf(" | | |\n");
    }
  }
  const std::string path = absl::GetFlag(FLAGS_jsonl);
  if (!path.empty()) {
    std::vector<nlohmann::json> records;
    auto record = [&](const Row& r, const char* system, double us) {
      records.push_back({{"metric", "attention_tflops"},
                         {"shape", absl::StrFormat("h%d_kv%d_d%d", kHeads,
                                                   kKvHeads, r.head_dim)},
                         {"system", system},
                         {"batch", 1},
                         {"tokens", r.tokens},
                         {"context", r.tokens},
                         {"value", r.flops / us / 1e6}});
    };
    for (const Row& r : rows) {
      record(r, "pdworker_mma", r.mma_us);
      if (r.mma32_us > 0) record(r, "pdworker_mma_w32", r.mma32_us);
      if (r.cuda_cores_us > 0) {
        record(r, "pdworker_cuda_cores", r.cuda_cores_us);
      }
      for (int c = 0; c < kNumWgmmaConfigs; ++c) {
        if (r.wgmma_us[c] > 0) {
          record(r, kWgmmaConfigs[c].system, r.wgmma_us[c]);
        }
      }
    }
    AppendGpuRecords(path, gpu, absl::GetFlag(FLAGS_commit),
                     std::move(records));
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
