// GPU decode benchmark (issue 9) on a Llama-3.2-1B-shaped model with random
// bf16 weights (tools/make_tiny_model --shape=llama_1b: hidden 2048,
// 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied
// embeddings). Prints Markdown tables for bench/RESULTS.md:
//
//  1. decode step time per graph mode (NONE, PIECEWISE, FULL) for batches
//     of 1, 8, 32 and 128 sequences at a fixed context, and FULL vs NONE;
//  2. the fraction of HBM bandwidth a batch-1 FULL step reaches: bytes the
//     step must read (weights + KV) / step time / the GPU's peak (H100 SXM
//     3.35 TB/s, H200 4.8 TB/s, from the device name, or --peak_tbps);
//  3. paged-attention kernel bandwidth (KV bytes read / kernel time) at
//     contexts of 1k, 4k and 16k tokens, for the split-K decode routine and
//     the varlen routine, measured on a replayed graph of back-to-back
//     launches (no launch overhead).
//
//   bazel build --config=opt //bench:gpu_decode_bench
//   bazel-bin/bench/gpu_decode_bench [--model_dir=DIR] [--reps=N]
//       [--batches=1,8,32,128] [--prefill_lens=64,...] [--json_out=FILE]
//
// The comparison against PyTorch (issue 10, bench/torch_compare/run.sh) runs
// it on checkpoints written by transformers with --batches=1,...,256,
// --prefill_lens=64,...,2048 and reads --json_out. Graphs are captured for
// vLLM's default sizes (1, 2, 4, then every multiple of 8) up to the largest
// batch, and for every prefill length (--prefill_graphs, so PIECEWISE vs
// eager prefills are measured); each mode's capture time and device memory
// (CaptureSummary) are reported.
//
// A step's time is ModelRunner::Execute's wall time: input upload, the
// forward (graph replay or eager launches), sampling and the copy of the
// sampled tokens back to the host, i.e. what a decode worker pays per step.
// Without a usable GPU the binary prints why and exits 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/gpu_bench_util.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/kernels/paged_attention.h"
#include "worker/model/float16.h"
#include "worker/model/llama_weights.h"
#include "worker/model/model_config.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_llama_1b",
          "Checkpoint directory; --shape is written there (bf16) unless it "
          "already holds a config.json.");
ABSL_FLAG(std::string, shape, "llama_1b",
          "The tiny-model shape written to an empty --model_dir: llama_1b "
          "(~2.5 GB), llama_0p5b (~1 GB), or issue 41's qwen3_8b_4layers "
          "(~4 GB) and gemma2_9b_4layers (~3.4 GB; both with "
          "--unverified_cuda_kernels=allow).");
ABSL_FLAG(int, reps, 20, "Timed decode steps per measurement (median).");
ABSL_FLAG(int, context, 512,
          "Prompt tokens of every sequence before the timed decode steps.");
ABSL_FLAG(double, peak_tbps, 0.0,
          "HBM peak in TB/s; 0: from the device name (H100 SXM 3.35, "
          "H100 PCIe 2.0, H100 NVL 3.9, H200 4.8).");
ABSL_FLAG(bool, attention_only, false, "Run only the attention kernel part.");
ABSL_FLAG(bool, skip_attention, false, "Skip the attention kernel part.");
ABSL_FLAG(std::string, device, "cuda",
          "cuda, or cpu to smoke-test the decode/prefill part on a small "
          "checkpoint (times are not GPU times then).");
ABSL_FLAG(std::vector<std::string>, batches,
          std::vector<std::string>({"1", "8", "32", "128"}),
          "Decode batch sizes (sequences per step).");
ABSL_FLAG(std::vector<std::string>, prefill_lens, {},
          "Batch-1 prefill lengths to time (tokens); empty: none.");
ABSL_FLAG(std::vector<std::string>, modes,
          std::vector<std::string>({"NONE", "PIECEWISE", "FULL"}),
          "cudagraph_mode values to measure.");
ABSL_FLAG(std::string, linear_kernel, "auto",
          "The projections' GEMM: auto, cublas, skinny_gemm or skinny_mma "
          "(kernels::LinearKernel; a skinny one runs launches of <= 8 rows, "
          "auto the rest), to compare step times side by side.");
ABSL_FLAG(std::string, decode_fusion, "on",
          "on (the default): RMSNorms, residual adds and RoPE + KV write "
          "fused into the skinny GEMMs' prologues and epilogues where they "
          "run; off: separate kernels.");
ABSL_FLAG(std::string, greedy_head, "on",
          "on (the default): a one-row step's LM head also folds its logits "
          "for the greedy sampler, which then skips its pass over them; "
          "off: the head's GEMM, then the sampler's slice kernel.");
ABSL_FLAG(std::string, megakernel, "off",
          "on: one-token decode steps run every layer in one cooperative "
          "kernel (DecodeMegakernel); off: kernel by kernel.");
ABSL_FLAG(int, megakernel_ctas_per_sm, 0,
          "The megakernel's resident CTAs per SM (0: as many as fit).");
ABSL_FLAG(std::string, megakernel_reduce, "last_split",
          "Where the megakernel reduces the attention's splits: last_split "
          "(the last split CTA of each kv head) or own_phase (a phase of its "
          "own behind one more grid barrier).");
ABSL_FLAG(int64_t, megakernel_prefetch_mib, -1,
          "MiB of weights ahead the megakernel asks L2 to prefetch (-1: half "
          "of L2, 0: none).");
ABSL_FLAG(std::string, decode_attention_pdl, "on",
          "on (the default): the decode attention's split and reduce "
          "kernels launch under programmatic dependent launch; off: fully "
          "serialized after the kernel before each.");
ABSL_FLAG(std::string, decode_attention, "auto",
          "The decode steps' attention split kernel: auto, cuda_cores or "
          "tensor_cores (where it covers the model).");
ABSL_FLAG(std::string, prefill_attention, "auto",
          "The varlen (prefill) steps' attention kernel: auto, tensor_cores "
          "(mma.sync), wgmma (compute capability 9.0) or cuda_cores.");
ABSL_FLAG(bool, prefill_graphs, true,
          "Capture graphs at the --prefill_lens sizes too, so PIECEWISE "
          "(and FULL) prefills replay a graph; false: they run eagerly "
          "past the largest batch, as before 2026-11-27.");
ABSL_FLAG(std::string, unverified_cuda_kernels, "refuse",
          "allow: run the CUDA kernels written without a GPU (Qwen3's q/k "
          "norm, partial rotary, Gemma's layer, windows), as the worker's "
          "--unverified_cuda_kernels; the qwen3_8b_4layers and "
          "gemma2_9b_4layers shapes need it.");
ABSL_FLAG(std::string, json_out, "",
          "Also write the results as JSON here (bench/torch_compare/report.py "
          "reads it).");

namespace pdworker {
namespace {

constexpr int kBlockSize = 16;
constexpr int kMaxBatchedTokens = 8192;

std::vector<int> ParseInts(const std::vector<std::string>& texts,
                           const char* flag) {
  std::vector<int> values;
  for (const std::string& text : texts) {
    int value = 0;
    CHECK(absl::SimpleAtoi(text, &value) && value > 0)
        << "--" << flag << ": \"" << text << "\" is not a positive integer";
    values.push_back(value);
  }
  return values;
}

// vLLM's default cudagraph_capture_sizes (1, 2, 4, then multiples of 8) up
// to the largest batch measured, so every measured batch has a graph, and
// (--prefill_graphs) every prefill length measured, so a prefill runs in a
// PIECEWISE (or FULL) graph of its own size instead of eagerly.
std::string CaptureSizesJson(int max_batch,
                             const std::vector<int>& prefill_lens) {
  std::vector<int> sizes = {1, 2, 4};
  for (int s = 8; s < max_batch + 8; s += 8) sizes.push_back(s);
  while (sizes.size() > 1 && sizes[sizes.size() - 2] >= max_batch) {
    sizes.pop_back();
  }
  if (absl::GetFlag(FLAGS_prefill_graphs)) {
    sizes.insert(sizes.end(), prefill_lens.begin(), prefill_lens.end());
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  }
  return absl::StrCat("[", absl::StrJoin(sizes, ","), "]");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Peak HBM bandwidth in bytes/s from the device name (0 when unknown).
double PeakBytesPerSecond(const std::string& name) {
  const double flag = absl::GetFlag(FLAGS_peak_tbps);
  if (flag > 0) return flag * 1e12;
  if (absl::StrContains(name, "H200")) return 4.8e12;
  if (absl::StrContains(name, "H100")) {
    if (absl::StrContains(name, "PCIe")) return 2.0e12;
    if (absl::StrContains(name, "NVL")) return 3.9e12;
    return 3.35e12;  // SXM (HBM3)
  }
  return 0.0;
}

std::unique_ptr<ModelRunner> MakeRunner(Device& device, const std::string& dir,
                                        const std::string& mode,
                                        int max_model_len, int max_batch,
                                        const std::vector<int>& prefill_lens) {
  auto model = LoadModelConfig(dir);
  CHECK(model.ok()) << model.status();
  ModelRunnerOptions o;
  o.role = Role::kBoth;
  o.max_num_seqs = max_batch;
  o.max_num_batched_tokens = std::max(kMaxBatchedTokens, max_batch);
  o.max_model_len = max_model_len;
  o.block_size = kBlockSize;
  // KV for max_batch sequences of max_model_len tokens: K and V, bf16 on CUDA
  // (32 KiB per token on llama_1b: 16 layers × 8 KV heads × 64 dims × 2 × 2
  // bytes), fp32 on the CPU backend.
  const int64_t element_bytes = device.kind() == DeviceKind::kCpu ? 4 : 2;
  const int64_t per_token =
      2 * element_bytes * model->num_hidden_layers * model->kv_size();
  o.kv_cache_bytes =
      int64_t{max_batch} * (max_model_len + kBlockSize) * per_token +
      (64 << 20);
  auto config = ParseCompilationConfig(absl::StrCat(
      R"({"cudagraph_mode":")", mode, R"(","cudagraph_capture_sizes":)",
      CaptureSizesJson(max_batch, prefill_lens), "}"));
  CHECK(config.ok()) << config.status();
  o.compilation = *config;
  const std::string kernel = absl::GetFlag(FLAGS_linear_kernel);
  CHECK(kernel == "auto" || kernel == "cublas" || kernel == "skinny_gemm" ||
        kernel == "skinny_mma")
      << "--linear_kernel: auto, cublas, skinny_gemm or skinny_mma, got "
      << kernel;
  o.kernel_options.linear_kernel =
      kernel == "cublas"        ? kernels::LinearKernel::kCublas
      : kernel == "skinny_gemm" ? kernels::LinearKernel::kSkinnyGemm
      : kernel == "skinny_mma"  ? kernels::LinearKernel::kSkinnyMma
                                : kernels::LinearKernel::kAuto;
  const std::string attention = absl::GetFlag(FLAGS_decode_attention);
  CHECK(attention == "auto" || attention == "cuda_cores" ||
        attention == "tensor_cores")
      << "--decode_attention: auto, cuda_cores or tensor_cores, got "
      << attention;
  o.kernel_options.decode_attention_kernel =
      attention == "tensor_cores" ? kernels::DecodeAttentionKernel::kTensorCores
      : attention == "cuda_cores" ? kernels::DecodeAttentionKernel::kCudaCores
                                  : kernels::DecodeAttentionKernel::kAuto;
  const std::string pdl = absl::GetFlag(FLAGS_decode_attention_pdl);
  CHECK(pdl == "on" || pdl == "off")
      << "--decode_attention_pdl: on or off, got " << pdl;
  o.kernel_options.decode_attention_pdl =
      pdl == "on" ? kernels::DecodeAttentionPdl::kOn
                  : kernels::DecodeAttentionPdl::kOff;
  const std::string prefill = absl::GetFlag(FLAGS_prefill_attention);
  CHECK(prefill == "auto" || prefill == "tensor_cores" || prefill == "wgmma" ||
        prefill == "cuda_cores")
      << "--prefill_attention: auto, tensor_cores, wgmma or cuda_cores, got "
      << prefill;
  o.kernel_options.varlen_attention_kernel =
      prefill == "tensor_cores" ? kernels::VarlenAttentionKernel::kTensorCores
      : prefill == "wgmma"      ? kernels::VarlenAttentionKernel::kWarpgroupMma
      : prefill == "cuda_cores" ? kernels::VarlenAttentionKernel::kCudaCores
                                : kernels::VarlenAttentionKernel::kAuto;
  const std::string fusion = absl::GetFlag(FLAGS_decode_fusion);
  CHECK(fusion == "on" || fusion == "off")
      << "--decode_fusion: on or off, got " << fusion;
  o.kernel_options.decode_fusion =
      fusion == "on" ? DecodeFusion::kOn : DecodeFusion::kOff;
  const std::string greedy_head = absl::GetFlag(FLAGS_greedy_head);
  CHECK(greedy_head == "on" || greedy_head == "off")
      << "--greedy_head: on or off, got " << greedy_head;
  o.kernel_options.greedy_head_fusion =
      greedy_head == "on" ? GreedyHeadFusion::kOn : GreedyHeadFusion::kOff;
  const std::string megakernel = absl::GetFlag(FLAGS_megakernel);
  CHECK(megakernel == "on" || megakernel == "off")
      << "--megakernel: on or off, got " << megakernel;
  o.kernel_options.decode_megakernel =
      megakernel == "on" ? DecodeMegakernel::kOn : DecodeMegakernel::kOff;
  o.kernel_options.megakernel_tuning.ctas_per_sm =
      absl::GetFlag(FLAGS_megakernel_ctas_per_sm);
  const std::string reduce = absl::GetFlag(FLAGS_megakernel_reduce);
  CHECK(reduce == "last_split" || reduce == "own_phase")
      << "--megakernel_reduce: last_split or own_phase, got " << reduce;
  o.kernel_options.megakernel_tuning.reduce =
      reduce == "last_split" ? kernels::MegakernelReduce::kLastSplit
                             : kernels::MegakernelReduce::kOwnPhase;
  const int64_t prefetch_mib = absl::GetFlag(FLAGS_megakernel_prefetch_mib);
  o.kernel_options.megakernel_tuning.prefetch_window_bytes =
      prefetch_mib < 0 ? -1 : prefetch_mib << 20;
  const std::string unverified = absl::GetFlag(FLAGS_unverified_cuda_kernels);
  CHECK(unverified == "refuse" || unverified == "allow")
      << "--unverified_cuda_kernels: refuse or allow, got " << unverified;
  o.kernel_options.unverified_cuda_kernels =
      unverified == "allow" ? UnverifiedCudaKernels::kAllow
                            : UnverifiedCudaKernels::kRefuse;
  auto runner = ModelRunner::Create(device, dir, o);
  CHECK(runner.ok()) << runner.status();
  return std::move(*runner);
}

struct DecodeResult {
  std::map<int, double> step_ms;      // batch -> median Execute ms
  std::map<int, std::string> ran_as;  // batch -> runtime mode that ran
  // FULL steps only: the forward alone (median replay of the step's graph,
  // event-timed, nothing uploaded or sampled) and the graph's nodes.
  std::map<int, double> forward_ms;
  std::map<int, size_t> graph_nodes;
  std::map<int, double> prefill_ms;  // prompt tokens -> median Execute ms
  std::map<int, std::string> prefill_ran_as;
  double capture_seconds = 0;
  int64_t capture_bytes = 0;  // device memory the captured graphs took
  int graphs = 0;
};

// Batch-1 prefills of `length` random tokens: median Execute time of `reps`
// fresh sequences (each released after its step) after one warm-up.
void MeasurePrefill(ModelRunner& r, int length, int reps, std::mt19937& rng,
                    DecodeResult& out) {
  const int vocab = static_cast<int>(r.model_config().vocab_size);
  std::vector<double> times;
  for (int rep = 0; rep < reps + 1; ++rep) {
    std::vector<int32_t> prompt(length);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    const SequenceStep step = MakeSequenceStep("prefill", std::move(prompt),
                                               SequenceCreation::kMustBeNew);
    const auto t0 = std::chrono::steady_clock::now();
    auto result = r.Execute({&step, 1});
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(result.ok()) << result.status();
    CHECK(r.Release("prefill").ok());
    out.prefill_ran_as[length] =
        std::string(RuntimeModeName(result->info.mode));
    if (rep >= 1) {
      times.push_back(
          std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  out.prefill_ms[length] = Median(times);
}

DecodeResult MeasureDecode(Device& device, const std::string& dir,
                           const std::string& mode, int context, int reps,
                           const std::vector<int>& batches,
                           const std::vector<int>& prefill_lens) {
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  int max_len = context + reps + 64;
  for (const int length : prefill_lens) max_len = std::max(max_len, length);
  auto r = MakeRunner(device, dir, mode, max_len, max_batch, prefill_lens);
  DecodeResult out;
  auto capture = r->CaptureGraphs();
  CHECK(capture.ok()) << capture.status();
  out.capture_seconds = capture->total_seconds;
  out.capture_bytes = capture->total_memory_delta_bytes;
  out.graphs = r->NumCapturedGraphs();
  const int vocab = static_cast<int>(r->model_config().vocab_size);
  std::mt19937 rng(1);
  for (const int length : prefill_lens) {
    MeasurePrefill(*r, length, std::max(3, reps / 4), rng, out);
  }
  int next_id = 0;
  for (const int batch : batches) {
    // Prefill `batch` prompts of `context` tokens (untimed, in chunks that
    // fit max_num_batched_tokens).
    std::vector<std::string> ids;
    const int per_step = std::max(1, kMaxBatchedTokens / context);
    for (int s0 = 0; s0 < batch; s0 += per_step) {
      std::vector<SequenceStep> prefill;
      for (int s = s0; s < std::min(batch, s0 + per_step); ++s) {
        ids.push_back(absl::StrCat("s", next_id++));
        std::vector<int32_t> prompt(context);
        for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
        prefill.push_back(MakeSequenceStep(ids.back(), std::move(prompt),
                                           SequenceCreation::kMustBeNew));
      }
      CHECK(r->Execute(prefill).ok());
    }
    std::vector<double> times;
    BatchDescriptor key;
    bool full = false;
    for (int rep = 0; rep < reps + 2; ++rep) {  // 2 warm-up steps
      std::vector<SequenceStep> step;
      for (const auto& id : ids) {
        step.push_back(MakeSequenceStep(id,
                                        {static_cast<int32_t>(rng() % vocab)},
                                        SequenceCreation::kMustExist));
      }
      const auto t0 = std::chrono::steady_clock::now();
      auto result = r->Execute(step);
      const auto t1 = std::chrono::steady_clock::now();
      CHECK(result.ok()) << result.status();
      out.ran_as[batch] = std::string(RuntimeModeName(result->info.mode));
      key = result->info.descriptor;
      full = result->info.mode == RuntimeMode::kFull;
      if (rep >= 2) {
        times.push_back(
            std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
    }
    out.step_ms[batch] = Median(times);
    if (full) {
      // The last step's graph again, on the inputs it left: what a
      // megakernel's per-token figure measures (it rewrites the same KV
      // slots, so the sequences are unchanged).
      const GraphWrapper& graphs = r->forward().full_wrapper();
      out.graph_nodes[batch] = graphs.NumNodes(key);
      auto start = device.CreateEvent();
      auto stop = device.CreateEvent();
      CHECK(start.ok() && stop.ok());
      CHECK(graphs.Replay(key).ok());  // warm-up
      std::vector<double> forward;
      for (int rep = 0; rep < reps; ++rep) {
        CHECK(r->stream().RecordEvent(**start).ok());
        CHECK(graphs.Replay(key).ok());
        CHECK(r->stream().RecordEvent(**stop).ok());
        auto ms = (*stop)->ElapsedMillisecondsSince(**start);
        CHECK(ms.ok()) << ms.status();
        forward.push_back(*ms);
      }
      out.forward_ms[batch] = Median(forward);
    }
    for (const auto& id : ids) CHECK(r->Release(id).ok());
  }
  return out;
}

// --- Attention kernel bandwidth ---------------------------------------------

struct AttentionResult {
  double decode_us = 0;      // split-K on CUDA cores
  double decode_mma_us = 0;  // split-K on tensor cores
  double varlen_us = 0;
  double kv_bytes = 0;
};

// One layer of Llama-3.2-1B attention for `batch` sequences of `context`
// tokens each, sequential blocks; kernel time from a replayed graph of
// kLaunches back-to-back launches, timed with events.
AttentionResult MeasureAttention(Device& device, Stream& stream, int batch,
                                 int context, int max_context) {
  constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 64, kLaunches = 20;
  const int max_blocks = max_context / kBlockSize;
  const int blocks_per_seq = context / kBlockSize;
  const int num_blocks = batch * blocks_per_seq;
  const size_t kv_elems =
      static_cast<size_t>(num_blocks) * kBlockSize * kKvHeads * kHeadDim;
  const size_t workspace = kernels::PagedAttentionWorkspaceBytes(
      batch, kHeads, kHeadDim, max_blocks, kBlockSize);
  const size_t q_bytes = static_cast<size_t>(batch) * kHeads * kHeadDim * 2;
  ArenaOptions options;
  options.capacity_bytes = 2 * kv_elems * 2 + 2 * q_bytes + workspace +
                           sizeof(int32_t) * batch * (max_blocks + 4) +
                           (1 << 20);
  options.name = "attention_bench";
  auto arena = Arena::Create(device, options);
  CHECK(arena.ok()) << arena.status();
  auto alloc = [&](size_t bytes) {
    auto b = (*arena)->Allocate(bytes);
    CHECK(b.ok()) << b.status();
    return *b;
  };
  kernels::PagedAttentionParams p;
  p.num_reqs = alloc(sizeof(int32_t));
  p.query_start_loc = alloc(sizeof(int32_t) * (batch + 1));
  p.seq_lens = alloc(sizeof(int32_t) * batch);
  p.block_tables = alloc(sizeof(int32_t) * batch * max_blocks);
  p.query = alloc(q_bytes);
  p.key_cache = alloc(2 * kv_elems);
  p.value_cache = alloc(2 * kv_elems);
  p.output = alloc(q_bytes);
  p.workspace = alloc(workspace);
  p.num_tokens = batch;
  p.max_num_seqs = batch;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.block_size = kBlockSize;
  p.num_blocks = num_blocks;
  p.max_blocks_per_seq = max_blocks;
  p.uniform_query_len = 1;
  p.dtype = DType::kBFloat16;

  std::vector<int32_t> qsl(batch + 1), lens(batch, context),
      tables(static_cast<size_t>(batch) * max_blocks, 0);
  for (int r = 0; r <= batch; ++r) qsl[r] = r;
  for (int r = 0; r < batch; ++r) {
    for (int b = 0; b < blocks_per_seq; ++b) {
      tables[static_cast<size_t>(r) * max_blocks + b] = r * blocks_per_seq + b;
    }
  }
  const int32_t num_reqs = batch;
  CHECK(stream.CopyToDevice(p.num_reqs, &num_reqs, sizeof(num_reqs)).ok());
  CHECK(
      stream.CopyToDevice(p.query_start_loc, qsl.data(), 4 * qsl.size()).ok());
  CHECK(stream.CopyToDevice(p.seq_lens, lens.data(), 4 * lens.size()).ok());
  CHECK(stream.CopyToDevice(p.block_tables, tables.data(), 4 * tables.size())
            .ok());
  // Random bf16 K/V and q in [-1, 1] (values do not change the timing, but
  // keep the softmax honest).
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> host(kv_elems);
  for (auto& v : host) v = FloatToBFloat16Bits(dist(rng));
  CHECK(stream.CopyToDevice(p.key_cache, host.data(), 2 * kv_elems).ok());
  CHECK(stream.CopyToDevice(p.value_cache, host.data(), 2 * kv_elems).ok());
  host.resize(q_bytes / 2);
  CHECK(stream.CopyToDevice(p.query, host.data(), q_bytes).ok());

  auto time_us = [&](bool decode) {
    return GraphReplayMicros(
        device, stream,
        [&] {
          return decode ? kernels::LaunchPagedAttentionUniformDecode(stream, p)
                        : kernels::LaunchPagedAttention(stream, p);
        },
        kLaunches);
  };
  AttentionResult out;
  p.decode_kernel = kernels::DecodeAttentionKernel::kCudaCores;
  out.decode_us = time_us(true);
  p.decode_kernel = kernels::DecodeAttentionKernel::kTensorCores;
  out.decode_mma_us = time_us(true);
  out.varlen_us = time_us(false);
  out.kv_bytes = 2.0 * 2.0 * batch * static_cast<double>(context) * kKvHeads *
                 kHeadDim;  // K and V, bf16
  return out;
}

void PrintTables(const std::vector<std::string>& modes,
                 const std::vector<int>& batches,
                 const std::vector<int>& prefill_lens,
                 std::map<std::string, DecodeResult>& results, int context,
                 int reps) {
  std::printf(
      "Decode step (ModelRunner::Execute), context %d tokens, median of %d "
      "steps, linear kernel %s, norm fusion %s, greedy head %s, ms:\n\n"
      "| batch |",
      context, reps, absl::GetFlag(FLAGS_linear_kernel).c_str(),
      absl::GetFlag(FLAGS_decode_fusion).c_str(),
      absl::GetFlag(FLAGS_greedy_head).c_str());
  for (const auto& mode : modes) std::printf(" %s |", mode.c_str());
  const bool ratio = results.count("NONE") && results.count("FULL");
  std::printf("%s ran as |\n| ---: |", ratio ? " FULL vs NONE |" : "");
  for (size_t i = 0; i < modes.size(); ++i) std::printf(" ---: |");
  std::printf("%s --- |\n", ratio ? " ---: |" : "");
  for (const int b : batches) {
    std::printf("| %d |", b);
    std::vector<std::string> ran;
    for (const auto& mode : modes) {
      std::printf(" %.3f |", results[mode].step_ms[b]);
      ran.push_back(results[mode].ran_as[b]);
    }
    if (ratio) {
      std::printf(" %.2fx |",
                  results["NONE"].step_ms[b] / results["FULL"].step_ms[b]);
    }
    std::printf(" %s |\n", absl::StrJoin(ran, "/").c_str());
  }
  if (results.count("FULL") && !results["FULL"].forward_ms.empty()) {
    std::printf(
        "\nFULL: the forward alone (graph replay, event-timed, median) vs "
        "the whole step, and the graph's nodes (kernels per step):\n\n"
        "| batch | forward ms | step ms | graph nodes |\n| ---: | ---: | ---: "
        "| ---: |\n");
    for (const auto& [b, ms] : results["FULL"].forward_ms) {
      std::printf("| %d | %.3f | %.3f | %zu |\n", b, ms,
                  results["FULL"].step_ms[b], results["FULL"].graph_nodes[b]);
    }
  }
  if (!prefill_lens.empty()) {
    std::printf("\nBatch-1 prefill, ms:\n\n| tokens |");
    for (const auto& mode : modes) std::printf(" %s |", mode.c_str());
    std::printf(" ran as |\n| ---: |");
    for (size_t i = 0; i < modes.size(); ++i) std::printf(" ---: |");
    std::printf(" --- |\n");
    for (const int length : prefill_lens) {
      std::printf("| %d |", length);
      std::vector<std::string> ran;
      for (const auto& mode : modes) {
        std::printf(" %.3f |", results[mode].prefill_ms[length]);
        ran.push_back(results[mode].prefill_ran_as[length]);
      }
      std::printf(" %s |\n", absl::StrJoin(ran, "/").c_str());
    }
  }
  std::printf(
      "\n| mode | graphs | capture s | capture MiB |\n| --- | ---: | ---: | "
      "---: |\n");
  for (const auto& mode : modes) {
    std::printf("| %s | %d | %.2f | %.1f |\n", mode.c_str(),
                results[mode].graphs, results[mode].capture_seconds,
                results[mode].capture_bytes / 1048576.0);
  }
}

// The JSON bench/torch_compare/report.py reads (README there).
void WriteJson(const std::string& path, const std::string& device,
               const std::string& dir, int context, double peak,
               double weight_bytes, double kv_bytes,
               std::map<std::string, DecodeResult>& results) {
  using Json = nlohmann::json;
  Json root = {
      {"device", device},
      {"linear_kernel", absl::GetFlag(FLAGS_linear_kernel)},
      {"decode_fusion", absl::GetFlag(FLAGS_decode_fusion)},
      {"greedy_head", absl::GetFlag(FLAGS_greedy_head)},
      {"decode_attention_pdl", absl::GetFlag(FLAGS_decode_attention_pdl)},
      {"megakernel", absl::GetFlag(FLAGS_megakernel)},
      {"megakernel_ctas_per_sm", absl::GetFlag(FLAGS_megakernel_ctas_per_sm)},
      {"megakernel_prefetch_mib", absl::GetFlag(FLAGS_megakernel_prefetch_mib)},
      {"megakernel_reduce", absl::GetFlag(FLAGS_megakernel_reduce)},
      {"decode_attention", absl::GetFlag(FLAGS_decode_attention)},
      {"prefill_attention", absl::GetFlag(FLAGS_prefill_attention)},
      {"model_dir", dir},
      {"context", context},
      {"weight_bytes", weight_bytes},
      {"kv_bytes_batch1", kv_bytes},
      {"peak_bytes_per_s", peak},
      {"decode", Json::array()},
      {"prefill", Json::array()},
      {"capture", Json::array()}};
  for (auto& [mode, r] : results) {
    for (const auto& [batch, ms] : r.step_ms) {
      nlohmann::json row = {{"mode", mode},
                            {"batch", batch},
                            {"step_ms", ms},
                            {"ran_as", r.ran_as[batch]}};
      if (r.forward_ms.count(batch)) {
        row["forward_ms"] = r.forward_ms[batch];
        row["graph_nodes"] = r.graph_nodes[batch];
      }
      root["decode"].push_back(row);
    }
    for (const auto& [tokens, ms] : r.prefill_ms) {
      root["prefill"].push_back({{"mode", mode},
                                 {"tokens", tokens},
                                 {"step_ms", ms},
                                 {"ran_as", r.prefill_ran_as[tokens]}});
    }
    root["capture"].push_back({{"mode", mode},
                               {"graphs", r.graphs},
                               {"seconds", r.capture_seconds},
                               {"memory_bytes", r.capture_bytes}});
  }
  std::ofstream file(path);
  file << root.dump(1) << "\n";
  CHECK(file.good()) << "cannot write " << path;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  const bool on_cpu = absl::GetFlag(FLAGS_device) == "cpu";
  CHECK(on_cpu || absl::GetFlag(FLAGS_device) == "cuda")
      << "--device must be cuda or cpu";
  auto device = CreateDevice(on_cpu ? DeviceKind::kCpu : DeviceKind::kCuda);
  if (!device.ok()) {
    std::printf("gpu_decode_bench: skipped, no usable CUDA device (%s)\n",
                std::string(device.status().message()).c_str());
    return 0;
  }
  const std::string name = (*device)->name();
  const double peak = PeakBytesPerSecond(name);
  std::printf("device: %s; HBM peak used: %s\n\n", name.c_str(),
              peak > 0 ? absl::StrFormat("%.2f TB/s", peak / 1e12).c_str()
                       : "unknown (pass --peak_tbps)");

  if (!absl::GetFlag(FLAGS_attention_only)) {
    const std::string dir = absl::GetFlag(FLAGS_model_dir);
    if (!LoadModelConfig(dir).ok()) {
      const std::string shape_name = absl::GetFlag(FLAGS_shape);
      absl::StatusOr<TinyShape> shape = ParseTinyShape(shape_name);
      CHECK(shape.ok()) << "--shape: " << shape.status();
      TinyModelOptions model;
      model.shape = *shape;
      model.dtype = DType::kBFloat16;
      std::printf("writing the %s checkpoint to %s ...\n", shape_name.c_str(),
                  dir.c_str());
      CHECK(WriteTinyModel(model, dir).ok());
    }
    auto config = LoadModelConfig(dir);
    CHECK(config.ok()) << config.status();
    const int context = absl::GetFlag(FLAGS_context);
    const int reps = absl::GetFlag(FLAGS_reps);
    const std::vector<int> batches =
        ParseInts(absl::GetFlag(FLAGS_batches), "batches");
    const std::vector<int> prefill_lens =
        ParseInts(absl::GetFlag(FLAGS_prefill_lens), "prefill_lens");
    const std::vector<std::string> modes = absl::GetFlag(FLAGS_modes);
    CHECK(!batches.empty() && !modes.empty());
    const auto has_mode = [&](const std::string& m) {
      return std::find(modes.begin(), modes.end(), m) != modes.end();
    };

    std::map<std::string, DecodeResult> results;
    for (const std::string& mode : modes) {
      results[mode] = MeasureDecode(**device, dir, mode, context, reps, batches,
                                    prefill_lens);
    }
    PrintTables(modes, batches, prefill_lens, results, context, reps);
    // Batch 1: the weights (one embedding row, the LM head matrix) plus the
    // KV of ~context tokens must cross HBM once per step.
    const double weight_bytes =
        static_cast<double>(LlamaDecodeWeightBytes(*config, DType::kBFloat16));
    const double kv_bytes = 2.0 * 2.0 * config->num_hidden_layers *
                            config->kv_size() * (context + reps / 2);
    const std::string best = has_mode("FULL") ? "FULL" : modes.back();
    const double step_s = results[best].step_ms[batches.front()] / 1e3;
    if (batches.front() == 1) {
      std::printf(
          "\nBatch 1, %s: %.3f ms per step; weights %.3f GB + KV %.1f MB; "
          "%.0f GB/s",
          best.c_str(), step_s * 1e3, weight_bytes / 1e9, kv_bytes / 1e6,
          (weight_bytes + kv_bytes) / step_s / 1e9);
      if (peak > 0) {
        std::printf(" = %.1f%% of peak (weights alone: %.1f%%)",
                    100.0 * (weight_bytes + kv_bytes) / step_s / peak,
                    100.0 * weight_bytes / step_s / peak);
      }
      std::printf("\n\n");
    }
    const std::string json_out = absl::GetFlag(FLAGS_json_out);
    if (!json_out.empty()) {
      WriteJson(json_out, name, dir, context, peak, weight_bytes, kv_bytes,
                results);
    }
  }
  // The attention part times bf16 CUDA kernels with events.
  if (absl::GetFlag(FLAGS_skip_attention) || on_cpu) return 0;

  auto stream = (*device)->CreateStream();
  CHECK(stream.ok()) << stream.status();
  std::printf(
      "Paged attention, one layer (32 heads, 8 KV heads, head_dim 64, block "
      "16), per launch:\n\n| batch | context | KV MB | split-K decode us | "
      "GB/s | %% peak | tensor-core split-K us | GB/s | %% peak | varlen us | "
      "GB/s |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
      "| ---: | ---: |\n");
  auto percent = [peak](double bw) {
    return peak > 0 ? absl::StrFormat("%.1f", 100.0 * bw / peak)
                    : std::string("-");
  };
  for (const int batch : {1, 32, 128}) {
    for (const int context : {1024, 4096, 16384}) {
      // 128 × 16k tokens would be 4 GiB of K/V per layer, filled from the
      // host: the bench keeps to 32 × 16k (the issue's shape) at the top.
      if (batch * static_cast<int64_t>(context) > 32 * 16384) continue;
      const AttentionResult a =
          MeasureAttention(**device, **stream, batch, context, 16384);
      const double decode_bw = a.kv_bytes / (a.decode_us * 1e-6);
      const double mma_bw = a.kv_bytes / (a.decode_mma_us * 1e-6);
      const double varlen_bw = a.kv_bytes / (a.varlen_us * 1e-6);
      std::printf(
          "| %d | %d | %.1f | %.1f | %.0f | %s | %.1f | %.0f | %s | %.1f | "
          "%.0f |\n",
          batch, context, a.kv_bytes / 1e6, a.decode_us, decode_bw / 1e9,
          percent(decode_bw).c_str(), a.decode_mma_us, mma_bw / 1e9,
          percent(mma_bw).c_str(), a.varlen_us, varlen_bw / 1e9);
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
