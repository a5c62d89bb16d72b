// Every configured CUDA graph mode runs the same batches bit-identically to
// eager (NONE), padding never touches real KV, and the statistics table
// records what actually ran.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/runner/model_runner_test_util.h"

namespace pdworker {
namespace {

using runner_testing::Seq;
using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

struct Expected {
  int unpadded;
  int padded;
  RuntimeMode mode;
};

struct ModeCase {
  const char* mode;
  // Per step, written out by hand from the seeds' dispatch rules with capture
  // sizes [1, 2, 4, 8, 16], max_num_seqs 8, query length 1.
  std::vector<Expected> steps;
};

constexpr RuntimeMode N = RuntimeMode::kNone;
constexpr RuntimeMode P = RuntimeMode::kPiecewise;
constexpr RuntimeMode F = RuntimeMode::kFull;

// The batches: (1) prefill a(7)+b(3): mixed 10 -> 16; (2) decode a,b:
// uniform 2; (3) decode a + prefill c(5): mixed 6 -> 8; (4) decode a,b,c:
// uniform 3 -> 4; (5) prefill d(20): above the largest size -> eager;
// (6) decode a,b,c,d: uniform 4.
const std::vector<ModeCase>& Cases() {
  static const auto* cases = new std::vector<ModeCase>{
      {"NONE",
       {{10, 10, N}, {2, 2, N}, {6, 6, N}, {3, 3, N}, {20, 20, N}, {4, 4, N}}},
      {"PIECEWISE",
       {{10, 16, P}, {2, 2, P}, {6, 8, P}, {3, 4, P}, {20, 20, N}, {4, 4, P}}},
      {"FULL",
       {{10, 16, F}, {2, 2, F}, {6, 8, F}, {3, 4, F}, {20, 20, N}, {4, 4, F}}},
      {"FULL_DECODE_ONLY",
       {{10, 10, N}, {2, 2, F}, {6, 6, N}, {3, 4, F}, {20, 20, N}, {4, 4, F}}},
      {"FULL_AND_PIECEWISE",
       {{10, 16, P}, {2, 2, F}, {6, 8, P}, {3, 4, F}, {20, 20, N}, {4, 4, F}}},
  };
  return *cases;
}

std::vector<std::vector<SequenceStep>> Batches() {
  std::vector<int32_t> d(20);
  for (int i = 0; i < 20; ++i) d[i] = 100 + i;
  return {
      {Seq("a", {5, 17, 42, 8, 99, 3, 61}), Seq("b", {1, 2, 3})},
      {Seq("a", {12}), Seq("b", {77})},
      {Seq("a", {7}), Seq("c", {150, 9, 44, 21, 33})},
      {Seq("a", {30}), Seq("b", {4}), Seq("c", {8})},
      {Seq("d", d)},
      {Seq("a", {31}), Seq("b", {5}), Seq("c", {2}), Seq("d", {6})},
  };
}

struct RunOutput {
  std::vector<std::vector<float>> logits;  // per step, real rows only
  std::vector<std::vector<uint8_t>> kv;    // per layer: K then V bytes
  std::vector<int32_t> used_blocks;        // blocks owned by a, b, c, d
};

RunOutput RunMode(const ModeCase& c, TinyShape shape) {
  RunOutput out;
  auto dir = TinyModelDir(shape);
  EXPECT_TRUE(dir.ok()) << dir.status();
  if (!dir.ok()) return out;
  CpuDevice device;
  const std::string json = std::string(R"({"cudagraph_mode":")") + c.mode +
                           R"(","cudagraph_capture_sizes":[1,2,4,8,16]})";
  auto runner = ModelRunner::Create(device, *dir, SmallOptions(json));
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return out;
  ModelRunner& r = **runner;
  EXPECT_EQ(r.resolved_mode().ToString(), c.mode);
  auto capture = r.CaptureGraphs();
  EXPECT_TRUE(capture.ok()) << capture.status();

  const auto batches = Batches();
  std::map<std::tuple<int, int, RuntimeMode>, int64_t> expected_rows;
  for (size_t i = 0; i < batches.size(); ++i) {
    auto result = r.Execute(batches[i]);
    EXPECT_TRUE(result.ok())
        << c.mode << " step " << i << ": " << result.status();
    if (!result.ok()) return out;
    const Expected& e = c.steps[i];
    EXPECT_EQ(result->info.unpadded_tokens, e.unpadded)
        << c.mode << " step " << i;
    EXPECT_EQ(result->info.padded_tokens, e.padded) << c.mode << " step " << i;
    EXPECT_EQ(result->info.mode, e.mode) << c.mode << " step " << i;
    ++expected_rows[{e.unpadded, e.padded, e.mode}];
    std::vector<float> logits;
    EXPECT_TRUE(
        r.ReadLogits(static_cast<int>(batches[i].size()), &logits).ok());
    out.logits.push_back(std::move(logits));
  }

  // The table records exactly what ran.
  std::map<std::tuple<int, int, RuntimeMode>, int64_t> table;
  for (const GraphStatsRow& row : r.graph_stats().Snapshot()) {
    EXPECT_EQ(row.num_paddings, row.padded_tokens - row.unpadded_tokens);
    table[{row.unpadded_tokens, row.padded_tokens, row.mode}] += row.count;
  }
  EXPECT_EQ(table, expected_rows) << c.mode;

  for (int layer = 0; layer < r.model_config().num_hidden_layers; ++layer) {
    for (auto part : {ModelRunner::KvPart::kKey, ModelRunner::KvPart::kValue}) {
      std::vector<uint8_t> bytes;
      EXPECT_TRUE(r.ReadKvCache(layer, part, &bytes).ok());
      out.kv.push_back(std::move(bytes));
    }
  }
  for (const char* id : {"a", "b", "c", "d"}) {
    const SequenceKv* kv = r.kv_cache().Find(id);
    EXPECT_NE(kv, nullptr);
    if (kv) {
      out.used_blocks.insert(out.used_blocks.end(), kv->blocks.begin(),
                             kv->blocks.end());
    }
  }
  return out;
}

class ModesTest : public ::testing::TestWithParam<TinyShape> {};

TEST_P(ModesTest, EveryModeIsBitIdenticalToEager) {
  const RunOutput eager = RunMode(Cases()[0], GetParam());
  ASSERT_FALSE(eager.logits.empty());
  for (size_t m = 1; m < Cases().size(); ++m) {
    const RunOutput graph = RunMode(Cases()[m], GetParam());
    ASSERT_EQ(graph.logits.size(), eager.logits.size()) << Cases()[m].mode;
    for (size_t s = 0; s < eager.logits.size(); ++s) {
      ASSERT_EQ(graph.logits[s].size(), eager.logits[s].size());
      EXPECT_EQ(std::memcmp(graph.logits[s].data(), eager.logits[s].data(),
                            eager.logits[s].size() * sizeof(float)),
                0)
          << Cases()[m].mode << " step " << s << " logits differ from eager";
    }
    // Same blocks in the same order (allocation is deterministic), so the
    // whole cache must match byte for byte, free blocks included.
    EXPECT_EQ(graph.used_blocks, eager.used_blocks);
    ASSERT_EQ(graph.kv.size(), eager.kv.size());
    for (size_t i = 0; i < eager.kv.size(); ++i) {
      EXPECT_TRUE(graph.kv[i] == eager.kv[i])
          << Cases()[m].mode << " KV cache " << i << " differs from eager";
    }
  }
}

// Padding tokens write no KV: every block no sequence owns still holds the
// CPU backend's fresh-memory pattern (0xFF) after padded graph steps.
TEST_P(ModesTest, PaddingNeverWritesKv) {
  const RunOutput out = RunMode(Cases()[2], GetParam());  // FULL: most padding
  ASSERT_FALSE(out.kv.empty());
  std::vector<bool> owned;
  const size_t cache_bytes = out.kv[0].size();
  // Blocks are equal-sized slices of each layer's cache.
  auto dir = TinyModelDir(GetParam());
  ASSERT_TRUE(dir.ok());
  auto config = LoadModelConfig(*dir);
  ASSERT_TRUE(config.ok());
  const size_t block_bytes =
      static_cast<size_t>(4 /*block_size*/) * config->kv_size() * sizeof(float);
  const size_t num_blocks = cache_bytes / block_bytes;
  owned.assign(num_blocks, false);
  for (int32_t b : out.used_blocks) owned[b] = true;
  int checked = 0;
  for (const auto& layer : out.kv) {
    for (size_t b = 0; b < num_blocks; ++b) {
      if (owned[b]) continue;
      const uint8_t* p = layer.data() + b * block_bytes;
      ASSERT_TRUE(
          std::all_of(p, p + block_bytes, [](uint8_t x) { return x == 0xFF; }))
          << "free block " << b << " was written";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

// Until CaptureGraphs() marks the capture lifecycle ready, steps run eagerly
// and say why; the runner's one lifecycle drives the dispatcher's reasons.
TEST_P(ModesTest, StepsBeforeCaptureRunEagerlyWithTheReason) {
  auto dir = TinyModelDir(GetParam());
  ASSERT_TRUE(dir.ok()) << dir.status();
  for (const char* mode : {"FULL_AND_PIECEWISE", "NONE"}) {
    CpuDevice device;
    const std::string json = std::string(R"({"cudagraph_mode":")") + mode +
                             R"(","cudagraph_capture_sizes":[1,2,4,8,16]})";
    auto runner = ModelRunner::Create(device, *dir, SmallOptions(json));
    ASSERT_TRUE(runner.ok()) << runner.status();
    ModelRunner& r = **runner;
    const bool graphs = std::string(mode) != "NONE";
    EXPECT_EQ(r.capture_lifecycle().stage(), CaptureStage::kNotCaptured);

    auto before = r.Execute({Seq("a", {12}), Seq("b", {77})});
    ASSERT_TRUE(before.ok()) << mode << ": " << before.status();
    EXPECT_EQ(before->info.mode, N) << mode;
    EXPECT_EQ(
        before->info.fallback_reason,
        graphs ? FallbackReason::kStillCapturing : FallbackReason::kModeNone)
        << mode;

    auto capture = r.CaptureGraphs();
    ASSERT_TRUE(capture.ok()) << mode << ": " << capture.status();
    EXPECT_EQ(r.capture_lifecycle().stage(), CaptureStage::kReady) << mode;
    EXPECT_EQ(r.NumCapturedGraphs() > 0, graphs) << mode;

    auto after = r.Execute({Seq("a", {13}), Seq("b", {78})});
    ASSERT_TRUE(after.ok()) << mode << ": " << after.status();
    EXPECT_EQ(after->info.mode, graphs ? F : N) << mode;
    EXPECT_EQ(after->info.fallback_reason,
              graphs ? FallbackReason::kNone : FallbackReason::kModeNone)
        << mode;
  }
}

// The CPU backend has one GEMM and one attention routine: forcing a CUDA
// kernel is refused up front, naming the option, before any memory is
// allocated.
TEST(ModelRunnerOptionsTest, ForcedLinearKernelIsRefusedOnTheCpuBackend) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(dir.ok()) << dir.status();
  CpuDevice device;
  ModelRunnerOptions options = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  options.kernel_options.linear_kernel = kernels::LinearKernel::kCublas;
  auto runner = ModelRunner::Create(device, *dir, options);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(runner.status().message(),
              ::testing::HasSubstr("linear_kernel must be auto"));
  options.kernel_options.linear_kernel = kernels::LinearKernel::kAuto;
  options.kernel_options.decode_attention_kernel =
      kernels::DecodeAttentionKernel::kTensorCores;
  runner = ModelRunner::Create(device, *dir, options);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(runner.status().message(),
              ::testing::HasSubstr("decode_attention_kernel must be auto"));
  options.kernel_options.decode_attention_kernel =
      kernels::DecodeAttentionKernel::kAuto;
  for (const auto kernel : {kernels::VarlenAttentionKernel::kTensorCores,
                            kernels::VarlenAttentionKernel::kWarpgroupMma,
                            kernels::VarlenAttentionKernel::kCudaCores}) {
    options.kernel_options.varlen_attention_kernel = kernel;
    runner = ModelRunner::Create(device, *dir, options);
    ASSERT_FALSE(runner.ok());
    EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(runner.status().message(),
                ::testing::HasSubstr("varlen_attention_kernel must be auto"));
  }
  options.kernel_options.varlen_attention_kernel =
      kernels::VarlenAttentionKernel::kAuto;
  options.kernel_options.decode_megakernel = DecodeMegakernel::kOn;
  runner = ModelRunner::Create(device, *dir, options);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(runner.status().message(),
              ::testing::HasSubstr("decode_megakernel must be off"));
  options.kernel_options.decode_megakernel = DecodeMegakernel::kOff;
  EXPECT_TRUE(ModelRunner::Create(device, *dir, options).ok());
}

// The CPU attention masks sliding layers to their window, so a windowed
// model keeps its full context there (no cap; the CUDA cap is
// model_runner_gpu_test's).
TEST(ModelRunnerOptionsTest, ASlidingWindowKeepsTheContextOnTheCpu) {
  auto dir = TinyModelDir(TinyShape::kMistralWindow);
  ASSERT_TRUE(dir.ok()) << dir.status();
  CpuDevice device;
  ModelRunnerOptions options = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  options.max_model_len = 0;  // the default: max_position_embeddings (512)
  auto runner = ModelRunner::Create(device, *dir, options);
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_EQ((*runner)->model_config().sliding_window, 8);
  EXPECT_EQ((*runner)->max_model_len(), 512);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ModesTest,
                         ::testing::Values(TinyShape::kGqa, TinyShape::kQkvBias,
                                           TinyShape::kQwen3),
                         [](const ::testing::TestParamInfo<TinyShape>& info) {
                           return std::string(TinyShapeName(info.param));
                         });

}  // namespace
}  // namespace pdworker
