// The model runner on CUDA (tag "gpu") against the model runner on the CPU
// backend, on the tiny checkpoints:
//  - logits of prefill, decode, mixed and padded batches within a bf16
//    tolerance, and greedy generation picking the same tokens;
//  - every graph mode within tolerance of eager (NONE) on CUDA, with a
//    report (not an assertion) of whether they were also bit-identical —
//    eager runs the real token count and graphs the padded one, and cuBLAS
//    may choose different algorithms for the two (model-level bit identity
//    at a fixed padded shape is asserted in llama_forward_gpu_test);
//  - the attention kernels' graph support leaves every mode unchanged.
//
// Tolerance (kLogitTolerance, absolute, logits of these models are O(1) with
// a spread of a few units): the CUDA runner rounds the weights and every
// activation to bf16 (8 significant bits: 2^-9 relative per rounding), about
// ten roundings per layer on the way to the logits, 2-3 layers; the errors
// are mostly independent, so they add up to ~1% of the activations, i.e.
// ~0.02-0.05 on a logit. 0.15 leaves 3x headroom; the mean difference
// (kMeanLogitTolerance) catches systematic errors that stay below it. Both
// are estimates made before the first GPU run: the test logs the observed
// max and mean so they can be tightened. Indexing, masking or RoPE bugs
// move logits by O(1); the kernel-level tests (tests/kernels/*_cuda_test)
// check each op at ~2^-8.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "glog/logging.h"
#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"
#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace {

using runner_testing::Seq;
using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

constexpr float kLogitTolerance = 0.15f;
constexpr float kMeanLogitTolerance = 0.03f;

struct Diff {
  float max = 0.0f;
  double mean = 0.0;
};

Diff Compare(const std::vector<float>& a, const std::vector<float>& b) {
  Diff d;
  if (a.size() != b.size() || a.empty()) {
    d.max = INFINITY;
    return d;
  }
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = std::fabs(a[i] - b[i]);
    if (!(x <= d.max)) d.max = x;  // NaN propagates as the max
    sum += x;
  }
  d.mean = sum / a.size();
  return d;
}

// What a run of steps returned: every row's token, logprobs and top
// logprobs, and each step's logits; compared bit for bit across configs.
struct StepOutcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs, raw_logprobs, top;
  std::vector<std::vector<float>> logits;
};

// Executes `batch` on `runner` and appends what it returned to `out`;
// returns the first row's token (the next decode input).
int32_t RecordStep(ModelRunner& runner, const std::vector<SequenceStep>& batch,
                   StepOutcome& out) {
  auto result = runner.Execute(batch);
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return 0;
  for (const SequenceResult& r : result->sequences) {
    out.tokens.push_back(r.token_id);
    out.logprobs.push_back(r.logprob);
    out.raw_logprobs.push_back(r.raw_logprob);
    for (const TopLogprob& t : r.top_logprobs) {
      out.top.push_back(static_cast<float>(t.token_id));
      out.top.push_back(t.logprob);
    }
  }
  std::vector<float> l;
  EXPECT_TRUE(runner.ReadLogits(static_cast<int>(batch.size()), &l).ok());
  out.logits.push_back(std::move(l));
  return result->sequences[0].token_id;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectSameBits(const StepOutcome& got, const StepOutcome& want) {
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_TRUE(SameBits(got.logprobs, want.logprobs));
  EXPECT_TRUE(SameBits(got.raw_logprobs, want.raw_logprobs));
  EXPECT_TRUE(SameBits(got.top, want.top));
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t s = 0; s < want.logits.size(); ++s) {
    EXPECT_TRUE(SameBits(got.logits[s], want.logits[s]))
        << "step " << s << " max diff "
        << Compare(got.logits[s], want.logits[s]).max;
  }
}

class RunnerGpuTest : public ::testing::TestWithParam<TinyShape> {
 protected:
  void SetUp() override {
    auto device = CreateDevice(DeviceKind::kCuda);
    if (!device.ok()) {
      GTEST_SKIP() << "CUDA backend not available here ("
                   << device.status().message()
                   << "); run the gpu-tagged targets on a GPU machine";
    }
    cuda_ = *std::move(device);
    auto dir = TinyModelDir(GetParam());
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }

  std::unique_ptr<ModelRunner> MakeRunner(Device& device,
                                          const std::string& json) {
    auto runner = ModelRunner::Create(device, dir_, SmallOptions(json));
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (!runner.ok()) return nullptr;
    const absl::StatusOr<CaptureSummary> capture = (*runner)->CaptureGraphs();
    EXPECT_TRUE(capture.ok()) << capture.status();
    return *std::move(runner);
  }

  std::unique_ptr<Device> cuda_;
  CpuDevice cpu_;
  std::string dir_;
};

// Batches of the CPU reference test: prefill (padded), decode, mixed,
// uniform decode padded to 4, decode.
std::vector<std::vector<SequenceStep>> ReferenceBatches() {
  return {
      {Seq("a", {5, 17, 42, 8, 99, 3, 61}), Seq("b", {1, 2, 3})},
      {Seq("a", {12}), Seq("b", {77})},
      {Seq("a", {7}), Seq("c", {150, 9, 44, 21, 33})},
      {Seq("a", {30}), Seq("b", {4}), Seq("c", {8})},
      {Seq("b", {5}), Seq("c", {2})},
  };
}

TEST_P(RunnerGpuTest, LogitsMatchTheCpuRunnerWithinBf16Tolerance) {
  const std::string json = R"({"cudagraph_capture_sizes":[1,2,4,8,16]})";
  auto gpu = MakeRunner(*cuda_, json);
  auto cpu = MakeRunner(cpu_, json);
  ASSERT_TRUE(gpu && cpu);
  EXPECT_EQ(gpu->resolved_mode().ToString(), cpu->resolved_mode().ToString());
  Diff worst;
  int step = 0;
  for (const auto& batch : ReferenceBatches()) {
    auto g = gpu->Execute(batch);
    auto c = cpu->Execute(batch);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(g->info.mode, c->info.mode) << "step " << step;
    EXPECT_EQ(g->info.padded_tokens, c->info.padded_tokens) << "step " << step;
    std::vector<float> gl, cl;
    ASSERT_TRUE(gpu->ReadLogits(static_cast<int>(batch.size()), &gl).ok());
    ASSERT_TRUE(cpu->ReadLogits(static_cast<int>(batch.size()), &cl).ok());
    const Diff d = Compare(gl, cl);
    EXPECT_LE(d.max, kLogitTolerance) << "step " << step;
    EXPECT_LE(d.mean, kMeanLogitTolerance) << "step " << step;
    worst.max = std::max(worst.max, d.max);
    worst.mean = std::max(worst.mean, d.mean);
    ++step;
  }
  LOG(INFO) << TinyShapeName(GetParam())
            << ": CUDA (bf16) vs CPU (fp32) logits, worst step: max |diff| "
            << worst.max << ", mean |diff| " << worst.mean;
  RecordProperty("max_logit_diff", std::to_string(worst.max));
  RecordProperty("mean_logit_diff", std::to_string(worst.mean));
}

// Greedy decoding, teacher-forced: both runners get the CPU's token at
// every step (so a legitimate near-tie flip does not derail the rest), and
// the CUDA runner's sampled token (its argmax kernel) must equal the CPU's
// wherever the CPU's top-2 logit margin exceeds twice the tolerance (closer
// calls may legitimately flip in bf16; they are counted, not compared).
TEST_P(RunnerGpuTest, GreedyTokensEqualTheCpuRunner) {
  auto gpu = MakeRunner(*cuda_, "{}");
  auto cpu = MakeRunner(cpu_, "{}");
  ASSERT_TRUE(gpu && cpu);
  const int vocab = static_cast<int>(cpu->model_config().vocab_size);
  std::vector<int32_t> next = {3, 14, 15, 92, 65, 35};
  int compared = 0, near_ties = 0;
  for (int i = 0; i < 32; ++i) {
    auto g = gpu->Execute({Seq("g", next)});
    auto c = cpu->Execute({Seq("g", next)});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(c.ok()) << c.status();
    std::vector<float> cl;
    ASSERT_TRUE(cpu->ReadLogits(1, &cl).ok());
    std::vector<float> top(cl.begin(), cl.begin() + vocab);
    std::partial_sort(top.begin(), top.begin() + 2, top.end(),
                      std::greater<float>());
    const float margin = top[0] - top[1];
    if (margin > 2 * kLogitTolerance) {
      EXPECT_EQ(g->sequences[0].token_id, c->sequences[0].token_id)
          << "token " << i << " (CPU margin " << margin << ")";
      ++compared;
    } else {
      ++near_ties;
    }
    next = {c->sequences[0].token_id};
  }
  LOG(INFO) << TinyShapeName(GetParam()) << ": greedy tokens compared "
            << compared << ", near ties skipped " << near_ties;
  RecordProperty("greedy_tokens_compared", compared);
  EXPECT_GE(compared, 4) << "too many near ties to say anything";
}

// Every cudagraph mode: the same steps as the CPU modes test, each within
// tolerance of eager on CUDA; and whether it was bit-identical (reported).
TEST_P(RunnerGpuTest, EveryModeMatchesEagerAndReportsBitIdentity) {
  std::vector<int32_t> d(20);
  for (int i = 0; i < 20; ++i) d[i] = 100 + i;
  const std::vector<std::vector<SequenceStep>> batches = {
      {Seq("a", {5, 17, 42, 8, 99, 3, 61}), Seq("b", {1, 2, 3})},
      {Seq("a", {12}), Seq("b", {77})},
      {Seq("a", {7}), Seq("c", {150, 9, 44, 21, 33})},
      {Seq("a", {30}), Seq("b", {4}), Seq("c", {8})},
      {Seq("d", d)},
      {Seq("a", {31}), Seq("b", {5}), Seq("c", {2}), Seq("d", {6})},
  };
  auto run_mode = [&](const std::string& mode) {
    std::vector<std::vector<float>> logits;
    auto runner =
        MakeRunner(*cuda_, R"({"cudagraph_mode":")" + mode +
                               R"(","cudagraph_capture_sizes":[1,2,4,8,16]})");
    if (!runner) return logits;
    // ALWAYS support: the configured mode is the resolved mode.
    EXPECT_EQ(runner->resolved_mode().ToString(), mode);
    EXPECT_TRUE(runner->downgrade_reason().empty());
    for (const auto& batch : batches) {
      auto result = runner->Execute(batch);
      EXPECT_TRUE(result.ok()) << mode << ": " << result.status();
      if (!result.ok()) return logits;
      std::vector<float> l;
      EXPECT_TRUE(runner->ReadLogits(static_cast<int>(batch.size()), &l).ok());
      logits.push_back(std::move(l));
    }
    return logits;
  };
  const auto eager = run_mode("NONE");
  ASSERT_EQ(eager.size(), batches.size());
  std::string report;
  for (const char* mode :
       {"PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}) {
    const auto graph = run_mode(mode);
    ASSERT_EQ(graph.size(), eager.size()) << mode;
    int identical = 0;
    for (size_t s = 0; s < eager.size(); ++s) {
      const Diff diff = Compare(graph[s], eager[s]);
      EXPECT_LE(diff.max, kLogitTolerance) << mode << " step " << s;
      if (graph[s].size() == eager[s].size() &&
          std::memcmp(graph[s].data(), eager[s].data(),
                      eager[s].size() * sizeof(float)) == 0) {
        ++identical;
      }
    }
    report += std::string(" ") + mode + ":" + std::to_string(identical) + "/" +
              std::to_string(eager.size());
  }
  LOG(INFO) << TinyShapeName(GetParam())
            << ": steps bit-identical to eager (unpadded) per mode:" << report;
  RecordProperty("bit_identical_steps_per_mode", report);
}

// The decode-step fusions (RMSNorm in the qkv / gate_up prologues, residual
// adds in the o_proj / down epilogues) change no bit of any logit: the same
// steps with DecodeFusion kOn and kOff, eager and in FULL graphs, with the
// default kernels and with the tensor-core skinny GEMM forced, both fused
// at 1..8 tokens here (kAuto runs the tensor-core kernel at 2..8 tokens on
// layers of up to 4,096 outputs, and every layer of the tiny models is
// that narrow). FusesDecodeLayers must be true where the fusion is
// expected, so the comparison cannot pass by running unfused twice.
TEST_P(RunnerGpuTest, DecodeFusionLeavesEveryLogitBitIdentical) {
  const std::vector<std::vector<SequenceStep>> batches = {
      {Seq("a", {5, 17, 42, 8, 99, 3, 61})},
      {Seq("a", {12})},
      {Seq("a", {7})},
      {Seq("b", {1, 2, 3}), Seq("c", {9})},
      {Seq("a", {30}), Seq("b", {4}), Seq("c", {8})},
      {Seq("a", {31}), Seq("b", {5})},
  };
  for (const kernels::LinearKernel kernel :
       {kernels::LinearKernel::kAuto, kernels::LinearKernel::kSkinnyMma}) {
    for (const char* mode : {"NONE", "FULL"}) {
      SCOPED_TRACE(std::string(mode) + (kernel == kernels::LinearKernel::kAuto
                                            ? " auto"
                                            : " skinny_mma"));
      std::vector<std::vector<float>> logits[2];
      for (const DecodeFusion fusion :
           {DecodeFusion::kOn, DecodeFusion::kOff}) {
        ModelRunnerOptions o =
            SmallOptions(R"({"cudagraph_mode":")" + std::string(mode) +
                         R"(","cudagraph_capture_sizes":[1,2,4,8]})");
        o.kernel_options.linear_kernel = kernel;
        o.kernel_options.decode_fusion = fusion;
        auto runner = ModelRunner::Create(*cuda_, dir_, o);
        ASSERT_TRUE(runner.ok()) << runner.status();
        ASSERT_TRUE((*runner)->CaptureGraphs().ok());
        const bool on = fusion == DecodeFusion::kOn;
        const bool fuses =
            on && runner_testing::CudaFusesDecode((*runner)->model_config());
        EXPECT_EQ((*runner)->forward().FusesDecodeLayers(1), fuses);
        EXPECT_EQ((*runner)->forward().FusesDecodeLayers(4), fuses);
        EXPECT_FALSE((*runner)->forward().FusesDecodeLayers(16));
        for (const auto& batch : batches) {
          ASSERT_TRUE((*runner)->Execute(batch).ok());
          std::vector<float> l;
          ASSERT_TRUE(
              (*runner)->ReadLogits(static_cast<int>(batch.size()), &l).ok());
          logits[on ? 0 : 1].push_back(std::move(l));
        }
      }
      ASSERT_EQ(logits[0].size(), logits[1].size());
      for (size_t s = 0; s < logits[0].size(); ++s) {
        ASSERT_EQ(logits[0][s].size(), logits[1][s].size());
        EXPECT_EQ(std::memcmp(logits[0][s].data(), logits[1][s].data(),
                              logits[0][s].size() * sizeof(float)),
                  0)
            << "step " << s << " max diff "
            << Compare(logits[0][s], logits[1][s]).max;
      }
    }
  }
}

// The LM head that folds a one-row step's logits for the greedy sampler
// (GreedyHeadFusion, lm_head_greedy.cu; with its own final norm) changes no
// token, logprob or logit: the same steps with kOn and kOff, eager and in
// FULL graphs; and so does the decode attention without PDL
// (DecodeAttentionPdl::kOff against the default kOn). The steps cover what
// must keep the sampler's own pass (a ban from min_tokens, a sampled row,
// two rows) next to the one-row greedy steps that skip it, with and
// without top logprobs. GreedyTiles must be set exactly for the one-row
// key with kOn, so the comparison cannot pass by running the unfused head
// twice.
TEST_P(RunnerGpuTest, GreedyHeadFusionChangesNoTokenLogprobOrLogit) {
  const ForwardContext one_row{RuntimeMode::kFull, {1, 1, true}};
  const ForwardContext two_rows{RuntimeMode::kFull, {2, 2, true}};
  for (const char* mode : {"NONE", "FULL"}) {
    SCOPED_TRACE(mode);
    // The defaults, the greedy head off, the attention's PDL off.
    constexpr int kConfigs = 3;
    StepOutcome outcome[kConfigs];
    for (int config = 0; config < kConfigs; ++config) {
      const bool on = config != 1;
      ModelRunnerOptions o =
          SmallOptions(R"({"cudagraph_mode":")" + std::string(mode) +
                       R"(","cudagraph_capture_sizes":[1,2,4,8]})");
      o.kernel_options.greedy_head_fusion =
          on ? GreedyHeadFusion::kOn : GreedyHeadFusion::kOff;
      if (config == 2) {
        o.kernel_options.decode_attention_pdl =
            kernels::DecodeAttentionPdl::kOff;
      }
      auto runner = ModelRunner::Create(*cuda_, dir_, o);
      ASSERT_TRUE(runner.ok()) << runner.status();
      ASSERT_TRUE((*runner)->CaptureGraphs().ok());
      EXPECT_EQ(
          (*runner)->forward().GreedyTiles(one_row).empty(),
          !(on && runner_testing::CudaGreedyHead((*runner)->model_config())));
      EXPECT_TRUE((*runner)->forward().GreedyTiles(two_rows).empty());
      ModelRunner& r = **runner;
      StepOutcome& out = outcome[config];
      int32_t last = RecordStep(r, {Seq("a", {5, 17, 42, 8, 99, 3, 61})}, out);
      for (int i = 0; i < 3; ++i) last = RecordStep(r, {Seq("a", {last})}, out);
      SequenceStep banned = Seq("a", {last});
      banned.banned_token_ids = {last, 0};
      last = RecordStep(r, {banned}, out);
      SequenceStep with_top = Seq("a", {last});
      with_top.num_top_logprobs = 3;
      last = RecordStep(r, {with_top}, out);
      SequenceStep sampled = Seq("a", {last});
      sampled.sampling.temperature = 0.8f;
      sampled.sampling.seed = 11;
      last = RecordStep(r, {sampled}, out);
      last = RecordStep(r, {Seq("a", {last}), Seq("b", {1, 2, 3})}, out);
      RecordStep(r, {Seq("a", {last})}, out);
    }
    for (int config = 1; config < kConfigs; ++config) {
      SCOPED_TRACE(config == 1 ? "greedy head off" : "attention PDL off");
      ExpectSameBits(outcome[config], outcome[0]);
    }
  }
}

// Several sampled rows per sequence (speculative verification, written
// without a GPU: refused on CUDA unless unverified kernels are allowed, as
// SmallOptions does): with uniform_decode_query_len 4, verify steps of
// 1 + 3 tokens (uniform: FULL graphs of 8 tokens; beside a prefill and a
// one-token decode: mixed), and a step of one-token decodes (its own FULL
// key), give every row's logits within tolerance of the CPU runner, and the
// same step modes.
TEST_P(RunnerGpuTest, SampledRowsMatchOneTokenSteps) {
  auto make = [this](Device& device) -> std::unique_ptr<ModelRunner> {
    ModelRunnerOptions o =
        SmallOptions(R"({"cudagraph_capture_sizes":[1,2,4,8,16]})");
    o.uniform_decode_query_len = 4;
    auto runner = ModelRunner::Create(device, dir_, o);
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (!runner.ok()) return nullptr;
    EXPECT_TRUE((*runner)->CaptureGraphs().ok());
    return *std::move(runner);
  };
  auto verify = [](const std::string& id, std::vector<int32_t> tokens) {
    SequenceStep s = Seq(id, std::move(tokens));
    s.num_samples = static_cast<int32_t>(s.token_ids.size());
    return s;
  };
  auto gpu = make(*cuda_);
  auto cpu = make(cpu_);
  ASSERT_TRUE(gpu && cpu);
  const std::vector<std::vector<SequenceStep>> batches = {
      {Seq("a", {5, 17, 42, 8, 99, 3, 61}), Seq("b", {1, 2, 3})},
      {verify("a", {12, 40, 41, 7}), verify("b", {77, 3, 9, 10})},
      {verify("a", {30, 31, 32, 33}), Seq("b", {4}),
       Seq("c", {150, 9, 44, 21, 33})},
      {verify("a", {6, 2, 8, 1}), verify("b", {5, 5, 5, 5}),
       verify("c", {2, 3, 4, 5})},
      // Nobody verifies: a one-token decode key's FULL graph.
      {Seq("a", {9}), Seq("b", {8}), Seq("c", {7})},
  };
  Diff worst;
  for (size_t i = 0; i < batches.size(); ++i) {
    auto g = gpu->Execute(batches[i]);
    auto c = cpu->Execute(batches[i]);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(g->info.mode, c->info.mode) << "step " << i;
    EXPECT_EQ(g->info.padded_tokens, c->info.padded_tokens) << "step " << i;
    int rows = 0;
    for (const SequenceStep& s : batches[i]) rows += s.num_samples;
    std::vector<float> gl, cl;
    ASSERT_TRUE(gpu->ReadLogits(rows, &gl).ok());
    ASSERT_TRUE(cpu->ReadLogits(rows, &cl).ok());
    const Diff d = Compare(gl, cl);
    EXPECT_LE(d.max, kLogitTolerance) << "step " << i;
    EXPECT_LE(d.mean, kMeanLogitTolerance) << "step " << i;
    worst.max = std::max(worst.max, d.max);
    worst.mean = std::max(worst.mean, d.mean);
  }
  LOG(INFO) << TinyShapeName(GetParam())
            << ": sampled rows, CUDA vs CPU logits, worst step: max |diff| "
            << worst.max << ", mean |diff| " << worst.mean;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, RunnerGpuTest,
                         ::testing::ValuesIn(AllTinyShapes()),
                         [](const ::testing::TestParamInfo<TinyShape>& info) {
                           return std::string(TinyShapeName(info.param));
                         });

// The decode megakernel runs the fused one-token step's CTA bodies on their
// virtual grids, so every token, logprob and logit of a batch-1 decode step
// must be the kernel-by-kernel step's bits; steps it does not run (prefill,
// two rows) must be untouched. On the head_dim 64 shape (the tensor-core
// decode attention it needs), with a 60-token prompt so the attention has
// several splits, and once more on 3 CTAs, so every phase runs several
// virtual CTAs on one CTA (and both halves of a CTA run split CTAs), with
// the attention's reduce done by the last split and in its own phase.
TEST(DecodeMegakernelGpuTest, KeepsEveryBitOfTheKernelByKernelStep) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    GTEST_SKIP() << "CUDA backend not available here ("
                 << device.status().message() << ")";
  }
  auto dir = TinyModelDir(TinyShape::kHeadDim64);
  ASSERT_TRUE(dir.ok()) << dir.status();
  const BatchDescriptor one_row{1, 1, true};
  // Off, on, on with 3 CTAs, on with the reduce in its own phase (3 CTAs).
  constexpr int kConfigs = 4;
  StepOutcome outcome[kConfigs];
  size_t one_row_nodes[kConfigs] = {};
  for (int config = 0; config < kConfigs; ++config) {
    SCOPED_TRACE(config);
    ModelRunnerOptions o =
        SmallOptions(R"({"cudagraph_mode":"FULL_AND_PIECEWISE",)"
                     R"("cudagraph_capture_sizes":[1,2,4,8]})");
    if (config > 0) o.kernel_options.decode_megakernel = DecodeMegakernel::kOn;
    if (config >= 2) o.kernel_options.megakernel_tuning.max_ctas = 3;
    if (config == 3) {
      o.kernel_options.megakernel_tuning.reduce =
          kernels::MegakernelReduce::kOwnPhase;
    }
    auto runner = ModelRunner::Create(**device, *dir, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    ASSERT_TRUE((*runner)->CaptureGraphs().ok());
    one_row_nodes[config] =
        (*runner)->forward().full_wrapper().NumNodes(one_row);
    ModelRunner& r = **runner;
    StepOutcome& out = outcome[config];
    std::vector<int32_t> prompt;
    for (int i = 0; i < 60; ++i) prompt.push_back((i * 37 + 11) % 512);
    int32_t last = RecordStep(r, {Seq("a", prompt)}, out);
    for (int i = 0; i < 6; ++i) last = RecordStep(r, {Seq("a", {last})}, out);
    SequenceStep with_top = Seq("a", {last});
    with_top.num_top_logprobs = 3;
    last = RecordStep(r, {with_top}, out);
    SequenceStep sampled = Seq("a", {last});
    sampled.sampling.temperature = 0.8f;
    sampled.sampling.seed = 5;
    last = RecordStep(r, {sampled}, out);
    last = RecordStep(r, {Seq("a", {last}), Seq("b", {1, 2, 3})}, out);
    for (int i = 0; i < 3; ++i) last = RecordStep(r, {Seq("a", {last})}, out);
  }
  // Off: two layers of kernels; on: the embedding, the megakernel, the head.
  EXPECT_GT(one_row_nodes[0], 10u);
  EXPECT_LE(one_row_nodes[1], 3u);
  EXPECT_GT(one_row_nodes[1], 0u);
  for (int config = 1; config < kConfigs; ++config) {
    SCOPED_TRACE(config == 1   ? "megakernel"
                 : config == 2 ? "megakernel on 3 CTAs"
                               : "megakernel, reduce phase, on 3 CTAs");
    ExpectSameBits(outcome[config], outcome[0]);
  }
}

// What the megakernel cannot run is refused at Create, naming the option:
// head_dim 8 (no tensor-core decode attention), the decode fusion off.
TEST(DecodeMegakernelGpuTest, ModelsItCannotRunAreRefused) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    GTEST_SKIP() << "CUDA backend not available here ("
                 << device.status().message() << ")";
  }
  for (const TinyShape shape : {TinyShape::kGqa, TinyShape::kHeadDim64}) {
    SCOPED_TRACE(TinyShapeName(shape));
    auto dir = TinyModelDir(shape);
    ASSERT_TRUE(dir.ok()) << dir.status();
    ModelRunnerOptions o = SmallOptions(R"({"cudagraph_mode":"FULL"})");
    o.kernel_options.decode_megakernel = DecodeMegakernel::kOn;
    if (shape == TinyShape::kHeadDim64)
      o.kernel_options.decode_fusion = DecodeFusion::kOff;
    auto runner = ModelRunner::Create(**device, *dir, o);
    ASSERT_FALSE(runner.ok());
    EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(runner.status().message().find("decode_megakernel"),
              std::string::npos)
        << runner.status();
  }
}

// No windowed CUDA attention yet: a sliding-window model's default
// max_model_len is its window there, and a longer one is refused naming it.
TEST(CudaRefusalGpuTest, ASlidingWindowCapsMaxModelLen) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    GTEST_SKIP() << "CUDA backend not available here ("
                 << device.status().message() << ")";
  }
  auto dir = TinyModelDir(TinyShape::kMistralWindow);
  ASSERT_TRUE(dir.ok()) << dir.status();
  ModelRunnerOptions options = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  // The windowed CUDA kernels have not run on a GPU yet: by default the
  // window caps the length instead.
  options.kernel_options.unverified_cuda_kernels =
      UnverifiedCudaKernels::kRefuse;
  options.max_model_len = 0;
  auto runner = ModelRunner::Create(**device, *dir, options);
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_EQ((*runner)->max_model_len(), 8);
  runner->reset();
  options.max_model_len = 9;
  auto refused = ModelRunner::Create(**device, *dir, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("window 8"), std::string::npos)
      << refused.status();
}

// A model whose layer needs CUDA kernels that have not run on a GPU yet is
// refused at Create by default, naming the features and the flag, never run
// without them.
TEST(CudaRefusalGpuTest, LayersWithUnverifiedCudaKernelsAreRefusedByName) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    GTEST_SKIP() << "CUDA backend not available here ("
                 << device.status().message() << ")";
  }
  // Kernels written without a GPU: refused unless allowed, by name.
  ModelRunnerOptions refuse = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  refuse.kernel_options.unverified_cuda_kernels =
      UnverifiedCudaKernels::kRefuse;
  auto dir = TinyModelDir(TinyShape::kQwen3);
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto runner = ModelRunner::Create(**device, *dir, refuse);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kUnimplemented);
  for (const char* name :
       {"q_norm", "Qwen3ForCausalLM", "--unverified_cuda_kernels=allow"}) {
    EXPECT_NE(runner.status().message().find(name), std::string::npos)
        << name << ": " << runner.status();
  }

  auto gemma = TinyModelDir(TinyShape::kGemma2);
  ASSERT_TRUE(gemma.ok()) << gemma.status();
  runner = ModelRunner::Create(**device, *gemma, refuse);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kUnimplemented);
  for (const char* feature :
       {"Gemma2ForCausalLM", "sandwich norms", "gelu_pytorch_tanh",
        "attn_logit_softcapping", "final_logit_softcapping",
        "embedding multiplier"}) {
    EXPECT_NE(runner.status().message().find(feature), std::string::npos)
        << feature << ": " << runner.status();
  }

  auto phi4_mini = TinyModelDir(TinyShape::kPhi4Mini);
  ASSERT_TRUE(phi4_mini.ok()) << phi4_mini.status();
  runner = ModelRunner::Create(**device, *phi4_mini, refuse);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(runner.status().message().find("partial rotary"), std::string::npos)
      << runner.status();
}

// Several sampled rows per sequence have not run on a GPU yet: refused by
// default (UNIMPLEMENTED, naming the flag), and the sequence is unchanged.
TEST(CudaRefusalGpuTest, SampledRowsAreRefusedByDefault) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    GTEST_SKIP() << "CUDA backend not available here ("
                 << device.status().message() << ")";
  }
  auto dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(dir.ok()) << dir.status();
  ModelRunnerOptions options = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  options.kernel_options.unverified_cuda_kernels =
      UnverifiedCudaKernels::kRefuse;
  options.uniform_decode_query_len = 4;
  auto runner = ModelRunner::Create(**device, *dir, options);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Execute({Seq("a", {1, 2, 3})}).ok());
  SequenceStep verify = Seq("a", {4, 5, 6, 7});
  verify.num_samples = 4;
  auto refused = (*runner)->Execute({verify});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(refused.status().message().find("--unverified_cuda_kernels=allow"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ((*runner)->kv_cache().Find("a")->num_tokens, 3);
}

}  // namespace
}  // namespace pdworker
