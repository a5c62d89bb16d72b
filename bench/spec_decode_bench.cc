// Speculative decoding (issue 42): engine-owned greedy requests with
// speculation off and with n-gram prompt lookup, side by side in one run,
// at C concurrent requests (1, 8, 64 by default), on two workloads:
//  - repetitive: a model that continues what its context repeats. Random
//    weights never do, so the `cycle` model is the --shape one edited to:
//    attention and MLP outputs zero (o_proj, down_proj), final norm weight
//    one, and lm_head row v the embedding of v's predecessor in its block
//    of 8 ids, so greedy decoding continues the cycle 8b, 8b+1, ..., 8b+7,
//    8b, ...; each prompt walks such a cycle 8 times. (A shape with tied
//    embeddings, llama_1b, has no lm_head to edit: it repeats its last token
//    instead.) An upper bound of what n-gram lookup gives (every draft
//    right), as on text a model copies; the layers still run in full.
//  - random: the --shape model (random weights) on pseudo-random prompts:
//    drafts are rare and mostly wrong, so this measures what speculation
//    costs when it does not help. For each: target steps per generated token
//    (every
// engine step, prefills included), tokens/s, time per output token (the
// median over requests of (last - first token) / (tokens - 1)), and with
// speculation the acceptance rate (accepted / draft tokens) and the mean
// acceptance length (1 + accepted / drafts, vLLM's definition). Then the
// cost of a verify step itself: ModelRunner steps of one sequence at a
// 448-token context, one token vs 1 + k tokens with a sample after each,
// in their FULL graphs (median of --step_reps).
//
//   bazel build --config=opt //bench:spec_decode_bench
//   bazel-bin/bench/spec_decode_bench [--tokens=128] [--concurrency=1,8,64]
//       [--k=3] [--prompt_lookup_min=2] [--prompt_lookup_max=4]
//       [--device=cpu|cuda] [--unverified_cuda_kernels=refuse|allow]
//       [--shape=small|llama_1b] [--model_dir=DIR] [--cycle_model_dir=DIR]
//       [--rounds=3] [--step_reps=50] [--json_out=FILE]
//
// Prints Markdown for bench/RESULTS.md. Greedy, EOS ignored.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/engine/engine.h"
#include "worker/model/safetensors.h"
#include "worker/model/safetensors_writer.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(int, tokens, 128, "Tokens generated per request.");
ABSL_FLAG(std::string, concurrency, "1,8,64", "Concurrent requests to run.");
ABSL_FLAG(int, k, 3, "num_speculative_tokens.");
ABSL_FLAG(int, prompt_lookup_min, 2, "Shortest n-gram matched.");
ABSL_FLAG(int, prompt_lookup_max, 4, "Longest n-gram matched.");
ABSL_FLAG(int, prompt_len, 64, "Prompt tokens per request.");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda.");
ABSL_FLAG(std::string, unverified_cuda_kernels, "refuse",
          "CUDA: allow runs the verify steps' kernels not yet run on a GPU.");
ABSL_FLAG(std::string, shape, "small",
          "Tiny-model shape of both checkpoints (small, llama_1b, ...).");
ABSL_FLAG(std::string, model_dir, "",
          "The random workload's checkpoint (default /tmp/pdworker_bench_"
          "<shape>); the --shape model is written there when it has no "
          "config.json.");
ABSL_FLAG(std::string, cycle_model_dir, "",
          "The repetitive workload's checkpoint (default /tmp/pdworker_bench_"
          "<shape>_cycle): the `cycle` model (see the file comment) is "
          "written there when it has no config.json.");
ABSL_FLAG(int, step_reps, 50, "Verify-step timing: steps per median.");
ABSL_FLAG(int, rounds, 3,
          "Runs of every configuration, interleaved; each figure is their "
          "median.");
ABSL_FLAG(std::string, json_out, "", "Also write the figures as JSON here.");
ABSL_FLAG(std::string, workloads, "repetitive,random", "Workloads to run.");
ABSL_FLAG(bool, show_tokens, false,
          "Print request 0's generated tokens (speculation off) per workload.");

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;

enum class Workload { kRepetitive, kRandom };
const char* WorkloadName(Workload w) {
  return w == Workload::kRepetitive ? "repetitive" : "random";
}

// Request i's prompt: the cycle of a block of 8 ids walked over and over
// (repetitive), or tokens of a multiplicative hash (no n-gram repeats to
// speak of).
std::vector<int32_t> Prompt(Workload w, int i, int length, int vocab) {
  std::vector<int32_t> p(length);
  const uint64_t block = static_cast<uint64_t>(i) * 37 % (vocab / 8);
  for (int j = 0; j < length; ++j) {
    const uint64_t x =
        w == Workload::kRepetitive
            ? 8 * block + j % 8
            : (static_cast<uint64_t>(i) * 7919 + j) * 0x9E3779B97F4A7C15ull >>
                  40;
    p[j] = static_cast<int32_t>(x % static_cast<uint64_t>(vocab));
  }
  return p;
}

// The `cycle` checkpoint (file comment): the `shape` one, edited.
void WriteCycleModel(TinyShape shape, const std::string& dir) {
  TinyModelOptions tiny;
  tiny.shape = shape;
  tiny.seed = 7;
  CHECK(WriteTinyModel(tiny, dir).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(dir + "/model.safetensors");
  CHECK(file.ok()) << file.status();
  std::vector<float> embed;
  CHECK((*file)->ReadAsFloat32("model.embed_tokens.weight", &embed).ok());
  const TensorInfo* embed_info = (*file)->Find("model.embed_tokens.weight");
  const int64_t vocab = embed_info->shape[0], hidden = embed_info->shape[1];
  SafetensorsWriter writer;
  for (const auto& [name, info] : (*file)->tensors()) {
    std::vector<float> values;
    CHECK((*file)->ReadAsFloat32(name, &values).ok());
    if (absl::EndsWith(name, "o_proj.weight") ||
        absl::EndsWith(name, "down_proj.weight")) {
      std::fill(values.begin(), values.end(), 0.0f);
    } else if (name == "model.norm.weight") {
      std::fill(values.begin(), values.end(), 1.0f);
    } else if (name == "lm_head.weight") {
      // logits[v] = <embed[t], embed[predecessor(v)]>: largest where
      // predecessor(v) = t (a random vector's square norm is ~16x its dot
      // product with another at hidden 256), i.e. v = t's successor.
      for (int64_t v = 0; v < vocab; ++v) {
        const int64_t pred = v / 8 * 8 + (v % 8 + 7) % 8;
        std::copy_n(embed.begin() + pred * hidden, hidden,
                    values.begin() + v * hidden);
      }
    }
    CHECK(writer.Add(name, DType::kFloat32, info.shape, values).ok());
  }
  file->reset();
  CHECK(writer.WriteToFile(dir + "/model.safetensors").ok());
}

struct Figures {
  double steps_per_token = 0;
  double tokens_per_second = 0;
  double tpot_us = 0;  // median over requests
  double acceptance_rate = -1;
  double mean_acceptance_length = -1;
};

Figures Median(std::vector<Figures> runs) {
  auto median = [&runs](double Figures::*f) {
    std::vector<double> v;
    for (const Figures& r : runs) v.push_back(r.*f);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  Figures m;
  m.steps_per_token = median(&Figures::steps_per_token);
  m.tokens_per_second = median(&Figures::tokens_per_second);
  m.tpot_us = median(&Figures::tpot_us);
  m.acceptance_rate = median(&Figures::acceptance_rate);
  m.mean_acceptance_length = median(&Figures::mean_acceptance_length);
  return m;
}

struct Setup {
  std::string model_dir;        // random workload
  std::string cycle_model_dir;  // repetitive workload
  DeviceKind device = DeviceKind::kCpu;
  int tokens = 128;
  int prompt_len = 64;
  int k = 3;
  UnverifiedCudaKernels unverified = UnverifiedCudaKernels::kRefuse;
};

std::unique_ptr<Device> NewDevice(const Setup& s) {
  DeviceOptions device_options;
  device_options.cpu.stream_execution = CpuStreamExecution::kThreaded;
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice(s.device, device_options);
  CHECK(device.ok()) << device.status();
  return *std::move(device);
}

ModelRunnerOptions RunnerOptions(const Setup& s, int query_len,
                                 int max_model_len) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;  // FULL_AND_PIECEWISE
  o.max_num_seqs = 64;
  o.max_num_batched_tokens = 2048;
  o.max_model_len = max_model_len;
  o.kv_cache_bytes = int64_t{512} << 20;
  o.block_size = 16;
  o.uniform_decode_query_len = query_len;
  o.kernel_options.unverified_cuda_kernels = s.unverified;
  return o;
}

// The verify-step timing's context: the tiny shapes allow 512 positions.
constexpr int kStepContext = 448;

// Median microseconds of a one-sequence step of 1 token and of 1 + k
// tokens sampling after each, at a kStepContext-token context, on the random
// workload's model (each step's tokens are trimmed again, so the context
// stays put).
std::pair<double, double> VerifyStepCost(const Setup& s) {
  std::unique_ptr<Device> device = NewDevice(s);
  auto runner = ModelRunner::Create(
      *device, s.model_dir, RunnerOptions(s, 1 + s.k, kStepContext + 64));
  CHECK(runner.ok()) << runner.status();
  CHECK((*runner)->CaptureGraphs().ok());
  ModelRunner& r = **runner;
  const int vocab = static_cast<int>(r.model_config().vocab_size);
  CHECK(r.Execute({MakeSequenceStep(
                      "s", Prompt(Workload::kRandom, 0, kStepContext, vocab),
                      SequenceCreation::kMustBeNew)})
            .ok());
  auto median_us = [&](int n) {
    std::vector<double> us;
    for (int i = 0; i < absl::GetFlag(FLAGS_step_reps); ++i) {
      SequenceStep step = MakeSequenceStep("s", std::vector<int32_t>(n, 7),
                                           SequenceCreation::kMustExist);
      step.num_samples = n;
      const auto t0 = Clock::now();
      absl::StatusOr<StepResult> result = r.Execute({step});
      us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      CHECK(result.ok()) << result.status();
      CHECK(result->info.mode == RuntimeMode::kFull) << result->info.mode;
      CHECK(r.Truncate("s", kStepContext).ok());
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  median_us(1);  // warm
  return {median_us(1), median_us(1 + s.k)};
}

// C requests of `workload` on a fresh runner and engine; `speculate` turns
// n-gram speculation on.
Figures Run(const Setup& s, Workload workload, int c, bool speculate) {
  std::unique_ptr<Device> device = NewDevice(s);
  auto runner = ModelRunner::Create(
      *device,
      workload == Workload::kRepetitive ? s.cycle_model_dir : s.model_dir,
      RunnerOptions(s, speculate ? 1 + s.k : 1, s.prompt_len + s.tokens + 16));
  CHECK(runner.ok()) << runner.status();
  CHECK((*runner)->CaptureGraphs().ok());
  const int vocab = static_cast<int>((*runner)->model_config().vocab_size);
  EngineOptions options;
  if (speculate) {
    options.speculative.method = SpeculativeMethod::kNgram;
    options.speculative.num_speculative_tokens = s.k;
    options.speculative.prompt_lookup_min =
        absl::GetFlag(FLAGS_prompt_lookup_min);
    options.speculative.prompt_lookup_max =
        absl::GetFlag(FLAGS_prompt_lookup_max);
  }
  Engine engine(**runner, options, /*metrics=*/nullptr);

  std::vector<std::vector<Clock::time_point>> arrivals(c);
  std::vector<int32_t> first_tokens;
  std::mutex mu;
  std::atomic<int> done{0};
  const auto submit_all = [&](const std::string& tag, bool timed) {
    done = 0;
    for (int i = 0; i < c; ++i) {
      auto request = std::make_unique<EngineRequest>();
      request->spec.request_id = absl::StrCat(tag, i);
      request->spec.prompt = Prompt(workload, i, s.prompt_len, vocab);
      request->spec.stop.max_tokens = s.tokens;
      request->spec.stop.eos = EosHandling::kIgnore;
      request->on_update = [&, i, timed](const RequestUpdate& u) {
        if (timed) {
          const auto now = Clock::now();
          std::lock_guard<std::mutex> lock(mu);
          arrivals[i].insert(arrivals[i].end(), u.new_token_ids.size(), now);
          if (i == 0) {
            first_tokens.insert(first_tokens.end(), u.new_token_ids.begin(),
                                u.new_token_ids.end());
          }
        }
        if (u.last()) {
          CHECK(u.status.ok()) << u.status;
          ++done;
        }
      };
      engine.Submit(std::move(request));
    }
    while (done < c) std::this_thread::sleep_for(std::chrono::microseconds(50));
  };
  submit_all("warm", false);
  const EngineSnapshot before = engine.snapshot();
  const auto t0 = Clock::now();
  submit_all("r", true);
  const double seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();
  const EngineSnapshot after = engine.snapshot();
  if (absl::GetFlag(FLAGS_show_tokens) && !speculate) {
    std::fprintf(stderr, "%s request 0:", WorkloadName(workload));
    for (const int32_t t : first_tokens) std::fprintf(stderr, " %d", t);
    std::fprintf(stderr, "\n");
  }
  Figures f;
  const double tokens = static_cast<double>(c) * s.tokens;
  f.steps_per_token = (after.steps - before.steps) / tokens;
  f.tokens_per_second = tokens / seconds;
  std::vector<double> tpot;
  for (const auto& a : arrivals) {
    if (a.size() < 2) continue;
    tpot.push_back(
        std::chrono::duration<double, std::micro>(a.back() - a.front())
            .count() /
        static_cast<double>(a.size() - 1));
  }
  std::sort(tpot.begin(), tpot.end());
  f.tpot_us = tpot.empty() ? 0 : tpot[tpot.size() / 2];
  const int64_t drafts = after.spec_drafts - before.spec_drafts;
  const int64_t draft_tokens =
      after.spec_draft_tokens - before.spec_draft_tokens;
  const int64_t accepted =
      after.spec_accepted_tokens - before.spec_accepted_tokens;
  if (speculate) {
    f.acceptance_rate =
        draft_tokens > 0 ? static_cast<double>(accepted) / draft_tokens : 0;
    f.mean_acceptance_length =
        drafts > 0 ? 1.0 + static_cast<double>(accepted) / drafts : 1.0;
  }
  return f;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  using namespace pdworker;
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  Setup s;
  absl::StatusOr<TinyShape> shape = ParseTinyShape(absl::GetFlag(FLAGS_shape));
  CHECK(shape.ok()) << shape.status();
  const std::string name(TinyShapeName(*shape));
  s.model_dir = absl::GetFlag(FLAGS_model_dir);
  if (s.model_dir.empty()) s.model_dir = "/tmp/pdworker_bench_" + name;
  s.cycle_model_dir = absl::GetFlag(FLAGS_cycle_model_dir);
  if (s.cycle_model_dir.empty()) {
    s.cycle_model_dir = "/tmp/pdworker_bench_" + name + "_cycle";
  }
  s.tokens = absl::GetFlag(FLAGS_tokens);
  s.prompt_len = absl::GetFlag(FLAGS_prompt_len);
  s.k = absl::GetFlag(FLAGS_k);
  s.device = absl::GetFlag(FLAGS_device) == "cuda" ? DeviceKind::kCuda
                                                   : DeviceKind::kCpu;
  s.unverified = absl::GetFlag(FLAGS_unverified_cuda_kernels) == "allow"
                     ? UnverifiedCudaKernels::kAllow
                     : UnverifiedCudaKernels::kRefuse;
  if (!std::ifstream(s.model_dir + "/config.json").good()) {
    TinyModelOptions tiny;
    tiny.shape = *shape;
    tiny.seed = 7;
    CHECK(WriteTinyModel(tiny, s.model_dir).ok());
  }
  if (!std::ifstream(s.cycle_model_dir + "/config.json").good()) {
    WriteCycleModel(*shape, s.cycle_model_dir);
  }
  std::vector<int> concurrency;
  for (absl::string_view c :
       absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int v = 0;
    CHECK(absl::SimpleAtoi(c, &v) && v > 0 && v <= 64) << c;
    concurrency.push_back(v);
  }
  const int rounds = absl::GetFlag(FLAGS_rounds);
  std::string json = "[";
  std::printf(
      "| workload | C | speculation | target steps / token | tokens/s | "
      "time per output token (us) | acceptance rate | mean acceptance "
      "length |\n|---|---|---|---|---|---|---|---|\n");
  for (Workload w : {Workload::kRepetitive, Workload::kRandom}) {
    if (!absl::StrContains(absl::GetFlag(FLAGS_workloads), WorkloadName(w))) {
      continue;
    }
    for (int c : concurrency) {
      std::vector<Figures> off, on;
      for (int r = 0; r < rounds; ++r) {
        off.push_back(Run(s, w, c, false));
        on.push_back(Run(s, w, c, true));
      }
      for (const bool spec : {false, true}) {
        const Figures f = Median(spec ? on : off);
        const std::string label =
            spec ? absl::StrCat("ngram k=", s.k) : std::string("off");
        std::printf(
            "| %s | %d | %s | %.3f | %.1f | %.0f | %s | %s |\n",
            WorkloadName(w), c, label.c_str(), f.steps_per_token,
            f.tokens_per_second, f.tpot_us,
            spec ? absl::StrCat(f.acceptance_rate).c_str() : "-",
            spec ? absl::StrCat(f.mean_acceptance_length).c_str() : "-");
        absl::StrAppend(
            &json, json.size() > 1 ? "," : "", "{\"workload\":\"",
            WorkloadName(w), "\",\"concurrency\":", c, ",\"speculation\":\"",
            label, "\",\"steps_per_token\":", f.steps_per_token,
            ",\"tokens_per_second\":", f.tokens_per_second,
            ",\"tpot_us\":", f.tpot_us,
            ",\"acceptance_rate\":", f.acceptance_rate,
            ",\"mean_acceptance_length\":", f.mean_acceptance_length, "}");
      }
      std::fflush(stdout);
    }
  }
  const auto [one_us, verify_us] = VerifyStepCost(s);
  std::printf(
      "\nOne sequence at a %d-token context, FULL graphs (median of %d): "
      "a 1-token step %.1f us, a 1+%d-token verify step %.1f us (%.2fx)\n",
      kStepContext, absl::GetFlag(FLAGS_step_reps), one_us, s.k, verify_us,
      verify_us / one_us);
  absl::StrAppend(&json, ",{\"step_1_token_us\":", one_us,
                  ",\"step_verify_us\":", verify_us, ",\"k\":", s.k, "}");
  json += "]";
  const std::string out = absl::GetFlag(FLAGS_json_out);
  if (!out.empty()) std::ofstream(out) << json << "\n";
  return 0;
}
