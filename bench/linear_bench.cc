// Decode-batch linears (issue 23 item 1): the projections of the 0.5B and 1B
// shapes at 1..8 tokens, cuBLAS vs the CUDA-core skinny GEMM and the
// tensor-core one (each at its split-K table's choice, with and without
// programmatic dependent launch, and at every split-K factor without), in µs
// per layer and GB/s of weight + activation bytes.
//
// Weights are cold, as in a decode step (the model is ~50x the L2): each
// launch of the timed graph reads the next of enough weight copies to span
// 256 MiB, so no launch finds its weights in the L2 (50 MiB on an H200).
// Time: median of 5 replays of a graph of back-to-back launches, events
// (no launch overhead); with PDL the next launch's weight loads overlap the
// previous one's tail, as they do between a step's layers.
//
//   bazel build --config=opt //bench:linear_bench
//   bazel-bin/bench/linear_bench [--tokens=1,2,4,8] [--jsonl=FILE
//       --commit=SHA]
// Without a usable GPU it prints why and exits 0.
#include <algorithm>
#include <cstdio>
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
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/linear_cuda.h"
#include "worker/model/float16.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(std::vector<std::string>, tokens,
          (std::vector<std::string>{"1", "2", "4", "8"}),
          "Token counts (1..8).");
ABSL_FLAG(std::string, jsonl, "", "Append gpu.jsonl records to this file.");
ABSL_FLAG(std::string, commit, "", "Commit the binary was built from.");

namespace pdworker {
namespace {

struct LayerShape {
  const char* model;
  const char* layer;
  int in;
  int out;
  bool bias;
  bool fp32_out;
  int per_step;  // how many of it a decode step runs (layers)
};

// Qwen2.5-0.5B (24 layers, qkv bias, tied 151,936-row head) and
// Llama-3.2-1B (16 layers, 128,256-row head).
constexpr LayerShape kShapes[] = {
    {"0.5b", "qkv", 896, 1152, true, false, 24},
    {"0.5b", "o_proj", 896, 896, false, false, 24},
    {"0.5b", "gate_up", 896, 9728, false, false, 24},
    {"0.5b", "down", 4864, 896, false, false, 24},
    {"0.5b", "lm_head", 896, 151936, false, true, 1},
    {"1b", "qkv", 2048, 3072, false, false, 16},
    {"1b", "o_proj", 2048, 2048, false, false, 16},
    {"1b", "gate_up", 2048, 16384, false, false, 16},
    {"1b", "down", 8192, 2048, false, false, 16},
    {"1b", "lm_head", 2048, 128256, false, true, 1},
};

constexpr int kSplits[] = {1, 2, 4, 8};
constexpr size_t kColdBytes = size_t{256} << 20;

struct Row {
  const LayerShape* shape;
  int tokens;
  double bytes;
  double cublas_us;
  double skinny_pdl_us;
  double skinny_us;
  int auto_split;
  double split_us[4];
  double mma_pdl_us;  // tensor-core skinny GEMM
  double mma_us;
  int mma_auto_split;
  double mma_split_us[4];
};

Row Measure(Device& device, Stream& stream, const LayerShape& s, int tokens) {
  const size_t weight_bytes = size_t{2} * s.in * s.out;
  const int copies = static_cast<int>(
      std::clamp<size_t>(kColdBytes / weight_bytes + 1, 1, 128));
  std::vector<DeviceMemory> owned;
  auto alloc = [&](size_t bytes) {
    auto memory = device.Allocate(bytes);
    CHECK(memory.ok()) << memory.status();
    owned.push_back(*std::move(memory));
    return owned.back().buffer();
  };
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto random_bf16 = [&](DeviceBuffer buffer, size_t n) {
    std::vector<uint16_t> host(n);
    for (auto& v : host) v = FloatToBFloat16Bits(dist(rng));
    CHECK(stream.CopyToDevice(buffer, host.data(), 2 * n).ok());
  };
  std::vector<DeviceBuffer> weights;
  for (int c = 0; c < copies; ++c) {
    weights.push_back(alloc(weight_bytes));
    if (c == 0) {
      random_bf16(weights[0], weight_bytes / 2);
    } else {
      CHECK(stream.CopyOnDevice(weights[c], weights[0], weight_bytes).ok());
    }
  }
  const DeviceBuffer input = alloc(size_t{2} * tokens * s.in);
  random_bf16(input, static_cast<size_t>(tokens) * s.in);
  DeviceBuffer bias;
  if (s.bias) {
    bias = alloc(size_t{2} * s.out);
    random_bf16(bias, s.out);
  }
  const DeviceBuffer output =
      alloc(static_cast<size_t>(s.fp32_out ? 4 : 2) * tokens * s.out);

  kernels::LinearCudaParams p;
  p.input = input.as<const __nv_bfloat16>();
  p.bias = s.bias ? bias.as<const __nv_bfloat16>() : nullptr;
  p.output = output.data();
  p.output_type = s.fp32_out ? kernels::LinearCudaOutput::kFloat32
                             : kernels::LinearCudaOutput::kBFloat16;
  p.num_tokens = tokens;
  p.in_features = s.in;
  p.out_features = s.out;
  auto time_us = [&](kernels::LinearCudaKernel kernel, int k_split, bool pdl) {
    int next = 0;
    p.kernel = kernel;
    p.programmatic_launch = pdl;
    return GraphReplayMicros(
        device, stream,
        [&]() -> absl::Status {
          kernels::LinearCudaParams q = p;
          q.weight = weights[next++ % copies].as<const __nv_bfloat16>();
          return kernels::LaunchCudaOp(
              stream, "linear_bench", [q, k_split](const OpContext& ctx) {
                auto cuda = static_cast<cudaStream_t>(ctx.cuda_stream);
                if (k_split > 0) {
                  const cudaError_t e =
                      q.kernel == kernels::LinearCudaKernel::kSkinnyMma
                          ? kernels::LaunchSkinnyMmaCuda(q, k_split, cuda)
                          : kernels::LaunchSkinnyGemmCuda(q, k_split, cuda);
                  return e == cudaSuccess
                             ? absl::OkStatus()
                             : absl::InternalError("skinny gemm launch");
                }
                const kernels::LinearCudaResult r = kernels::LaunchLinearCuda(
                    q, cuda, static_cast<cublasHandle_t>(ctx.cublas_handle));
                return r.launch == cudaSuccess &&
                               r.cublas == CUBLAS_STATUS_SUCCESS
                           ? absl::OkStatus()
                           : absl::InternalError("linear launch");
              });
        },
        std::max(copies, 20));
  };
  Row row{};
  row.shape = &s;
  row.tokens = tokens;
  row.bytes = weight_bytes + 2.0 * tokens * s.in +
              (s.fp32_out ? 4.0 : 2.0) * tokens * s.out;
  row.cublas_us = time_us(kernels::LinearCudaKernel::kCublas, 0, false);
  row.skinny_pdl_us = time_us(kernels::LinearCudaKernel::kSkinnyGemm, 0, true);
  row.skinny_us = time_us(kernels::LinearCudaKernel::kSkinnyGemm, 0, false);
  row.auto_split = kernels::SkinnyGemmKSplit(s.in, s.out);
  for (int i = 0; i < 4; ++i) {
    row.split_us[i] =
        time_us(kernels::LinearCudaKernel::kSkinnyGemm, kSplits[i], false);
  }
  row.mma_pdl_us = time_us(kernels::LinearCudaKernel::kSkinnyMma, 0, true);
  row.mma_us = time_us(kernels::LinearCudaKernel::kSkinnyMma, 0, false);
  row.mma_auto_split = kernels::SkinnyMmaKSplit(s.in, s.out);
  for (int i = 0; i < 4; ++i) {
    row.mma_split_us[i] =
        time_us(kernels::LinearCudaKernel::kSkinnyMma, kSplits[i], false);
  }
  return row;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  std::optional<BenchGpu> bench_gpu = OpenBenchGpu("linear_bench");
  if (!bench_gpu) return 0;
  Device& device = *bench_gpu->device;
  Stream& stream = *bench_gpu->stream;
  const std::string gpu = device.name();
  std::vector<int> token_counts;
  for (const std::string& t : absl::GetFlag(FLAGS_tokens)) {
    int v = 0;
    CHECK(absl::SimpleAtoi(t, &v) && v >= 1 &&
          v <= kernels::kSkinnyGemmMaxTokens)
        << "--tokens: 1..8, got " << t;
    token_counts.push_back(v);
  }
  std::vector<Row> rows;
  for (const LayerShape& s : kShapes) {
    for (const int t : token_counts) {
      rows.push_back(Measure(device, stream, s, t));
    }
  }
  std::printf(
      "device: %s; weights cold (rotated copies over 256 MiB); GB/s counts "
      "weight + input + output bytes\n\n",
      gpu.c_str());
  std::printf(
      "| model | layer | in→out | tokens | cuBLAS µs | GB/s | skinny+PDL µs | "
      "GB/s | skinny µs | split | S=1 | S=2 | S=4 | S=8 | cuBLAS / "
      "skinny+PDL |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf(
        "| %s | %s | %d→%d | %d | %.2f | %.0f | %.2f | %.0f | %.2f | %d | "
        "%.2f | %.2f | %.2f | %.2f | %.2fx |\n",
        r.shape->model, r.shape->layer, r.shape->in, r.shape->out, r.tokens,
        r.cublas_us, r.bytes / r.cublas_us / 1e3, r.skinny_pdl_us,
        r.bytes / r.skinny_pdl_us / 1e3, r.skinny_us, r.auto_split,
        r.split_us[0], r.split_us[1], r.split_us[2], r.split_us[3],
        r.cublas_us / r.skinny_pdl_us);
  }
  std::printf(
      "\nTensor-core skinny GEMM (skinny_gemm_mma.cu):\n\n| model | layer | "
      "in→out | tokens | cuBLAS µs | mma+PDL µs | GB/s | mma µs | split | "
      "S=1 | S=2 | S=4 | S=8 | cuBLAS / mma+PDL | skinny+PDL / mma+PDL "
      "|\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
      "| ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf(
        "| %s | %s | %d→%d | %d | %.2f | %.2f | %.0f | %.2f | %d | %.2f | "
        "%.2f | %.2f | %.2f | %.2fx | %.2fx |\n",
        r.shape->model, r.shape->layer, r.shape->in, r.shape->out, r.tokens,
        r.cublas_us, r.mma_pdl_us, r.bytes / r.mma_pdl_us / 1e3, r.mma_us,
        r.mma_auto_split, r.mma_split_us[0], r.mma_split_us[1],
        r.mma_split_us[2], r.mma_split_us[3], r.cublas_us / r.mma_pdl_us,
        r.skinny_pdl_us / r.mma_pdl_us);
  }
  // A decode step's linears: each layer's projections times the layer
  // count, plus the head.
  std::printf(
      "\n| model | tokens | step linears cuBLAS µs | skinny+PDL µs | "
      "ratio | mma+PDL µs | ratio |\n| --- | ---: | ---: | ---: | ---: | "
      "---: | ---: |\n");
  for (const char* model : {"0.5b", "1b"}) {
    for (const int t : token_counts) {
      double cublas = 0, skinny = 0, mma = 0;
      for (const Row& r : rows) {
        if (std::string(r.shape->model) != model || r.tokens != t) continue;
        cublas += r.cublas_us * r.shape->per_step;
        skinny += r.skinny_pdl_us * r.shape->per_step;
        mma += r.mma_pdl_us * r.shape->per_step;
      }
      std::printf("| %s | %d | %.1f | %.1f | %.2fx | %.1f | %.2fx |\n", model,
                  t, cublas, skinny, cublas / skinny, mma, cublas / mma);
    }
  }
  const std::string path = absl::GetFlag(FLAGS_jsonl);
  if (!path.empty()) {
    std::vector<nlohmann::json> records;
    for (const Row& r : rows) {
      const std::string shape =
          absl::StrFormat("%s_%s_%dx%d", r.shape->model, r.shape->layer,
                          r.shape->in, r.shape->out);
      auto record = [&](const char* system, double us) {
        records.push_back({{"metric", "linear_us"},
                           {"shape", shape},
                           {"system", system},
                           {"batch", r.tokens},
                           {"tokens", r.tokens},
                           {"value", us},
                           {"gbps", r.bytes / us / 1e3}});
      };
      record("cublas", r.cublas_us);
      record("pdworker_skinny_pdl", r.skinny_pdl_us);
      record("pdworker_skinny", r.skinny_us);
      record("pdworker_skinny_mma_pdl", r.mma_pdl_us);
      record("pdworker_skinny_mma", r.mma_us);
    }
    AppendGpuRecords(path, gpu, absl::GetFlag(FLAGS_commit),
                     std::move(records));
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
