// Prefix caching through the ModelRunner, on the CPU backend, in every graph
// mode: a runner with caching on produces the same tokens and bit-identical
// logits as one with caching off, for prompts that share no, one, some and
// all blocks of a cached prompt, for chunked prompts, after evictions and
// after a rollback into a shared block, while its steps compute only the
// uncached tokens.
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"

namespace pdworker {
namespace {

using runner_testing::Seq;
using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

constexpr int kBs = 4;  // SmallOptions' block size

std::vector<int32_t> Tokens(int32_t seed, int n) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((seed * 37 + i * 11) % 200 + 1);
  return t;
}

std::vector<int32_t> Join(std::vector<int32_t> a,
                          const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

SequenceStep Start(const std::string& id, std::vector<int32_t> tokens) {
  SequenceStep s = Seq(id, std::move(tokens));
  s.creation = SequenceCreation::kMustBeNew;
  return s;
}

SequenceStep Next(const std::string& id, std::vector<int32_t> tokens) {
  SequenceStep s = Seq(id, std::move(tokens));
  s.creation = SequenceCreation::kMustExist;
  return s;
}

// One scripted step and what caching must save on it.
struct ScriptStep {
  std::vector<SequenceStep> batch;
  std::vector<std::string> release_after;
  std::vector<int32_t> cached;  // per row, with caching on
  // Roll back a sequence to a length after this step (a failed chunked
  // call's undo), as the engine does.
  std::string truncate_id = "";
  int32_t truncate_to = -1;
};

std::vector<ScriptStep> Script() {
  const std::vector<int32_t> sys = Tokens(1, 13);  // 3 full blocks + 1
  const std::vector<int32_t> first12(sys.begin(), sys.begin() + 12);
  const std::vector<int32_t> first4(sys.begin(), sys.begin() + 4);
  std::vector<ScriptStep> s;
  s.push_back({{Start("sys", sys)}, {}, {0}});
  // All 3 full blocks shared + a decode of sys in the same step.
  s.push_back(
      {{Next("sys", {9}), Start("all", Join(first12, {5, 6}))}, {}, {0, 12}});
  // One block shared; none shared.
  s.push_back(
      {{Start("one", Join(first4, Tokens(2, 6))), Start("none", Tokens(3, 9))},
       {},
       {4, 0}});
  // Exactly the cached prompt: its last token is computed again.
  s.push_back({{Start("same", sys)}, {}, {12}});
  // A chunked prompt: its first chunk (15 tokens) finds 3 blocks, the rest
  // continues.
  s.push_back({{Start("chunked", Join(first12, Tokens(4, 3)))}, {}, {12}});
  s.push_back({{Next("chunked", Tokens(5, 10))}, {}, {0}});
  // Decode everything, releasing some: their blocks stay cached.
  s.push_back({{Next("sys", {3}), Next("all", {4}), Next("one", {5}),
                Next("none", {6}), Next("same", {7}), Next("chunked", {8})},
               {"all", "one", "same"},
               {0, 0, 0, 0, 0, 0}});
  // A freed prompt's blocks are found again.
  s.push_back(
      {{Start("again", Join(Join(first4, Tokens(2, 6)), {1, 2}))}, {}, {8}});
  // Roll "sys" back into its shared second block, then continue it: the
  // others sharing the block must not see the new tokens.
  s.push_back({{Next("sys", {11})}, {}, {0}, "sys", 6});
  s.push_back(
      {{Next("sys", Tokens(6, 5)), Start("after", first12)}, {}, {0, 8}});
  s.push_back({{Next("sys", {1}), Next("after", {2}), Next("again", {3}),
                Next("none", {4})},
               {},
               {0, 0, 0, 0}});
  return s;
}

struct RunOutput {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int> unpadded_tokens;
};

RunOutput RunScript(const std::string& mode, PrefixCaching caching,
                    int64_t kv_cache_bytes,
                    const std::vector<ScriptStep>& script,
                    TinyShape shape = TinyShape::kGqa) {
  RunOutput out;
  auto dir = TinyModelDir(shape);
  EXPECT_TRUE(dir.ok()) << dir.status();
  if (!dir.ok()) return out;
  CpuDevice device;
  ModelRunnerOptions options =
      SmallOptions(R"({"cudagraph_mode":")" + mode +
                   R"(","cudagraph_capture_sizes":[1,2,4,8,16]})");
  options.prefix_caching = caching;
  if (kv_cache_bytes > 0) options.kv_cache_bytes = kv_cache_bytes;
  auto runner = ModelRunner::Create(device, *dir, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return out;
  ModelRunner& r = **runner;
  EXPECT_TRUE(r.CaptureGraphs().ok());
  for (size_t i = 0; i < script.size(); ++i) {
    const ScriptStep& step = script[i];
    auto result = r.Execute(step.batch);
    EXPECT_TRUE(result.ok())
        << mode << " step " << i << ": " << result.status();
    if (!result.ok()) return out;
    std::vector<int32_t> tokens;
    int expected_query = 0;
    for (size_t row = 0; row < step.batch.size(); ++row) {
      const SequenceResult& seq = result->sequences[row];
      tokens.push_back(seq.token_id);
      const int32_t cached =
          caching == PrefixCaching::kOn ? step.cached[row] : 0;
      EXPECT_EQ(seq.cached_tokens, cached)
          << mode << " step " << i << " row " << row;
      expected_query +=
          static_cast<int>(step.batch[row].token_ids.size()) - cached;
    }
    // The dispatcher saw the real query: only uncached tokens.
    EXPECT_EQ(result->info.unpadded_tokens, expected_query)
        << mode << " step " << i;
    out.tokens.push_back(tokens);
    out.unpadded_tokens.push_back(result->info.unpadded_tokens);
    std::vector<float> logits;
    EXPECT_TRUE(
        r.ReadLogits(static_cast<int>(step.batch.size()), &logits).ok());
    out.logits.push_back(std::move(logits));
    for (const std::string& id : step.release_after) {
      EXPECT_TRUE(r.Release(id).ok()) << id;
    }
    if (step.truncate_to >= 0) {
      EXPECT_TRUE(r.Truncate(step.truncate_id, step.truncate_to).ok());
    }
  }
  return out;
}

void ExpectSame(const RunOutput& on, const RunOutput& off,
                const std::string& what) {
  ASSERT_EQ(on.logits.size(), off.logits.size()) << what;
  for (size_t i = 0; i < on.logits.size(); ++i) {
    EXPECT_EQ(on.tokens[i], off.tokens[i]) << what << " step " << i;
    ASSERT_EQ(on.logits[i].size(), off.logits[i].size()) << what;
    EXPECT_EQ(std::memcmp(on.logits[i].data(), off.logits[i].data(),
                          on.logits[i].size() * sizeof(float)),
              0)
        << what << " step " << i << ": logits differ";
  }
}

class PrefixCacheRunnerTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PrefixCacheRunnerTest, SameOutputsAsWithoutCaching) {
  const std::vector<ScriptStep> script = Script();
  const RunOutput off = RunScript(GetParam(), PrefixCaching::kOff, 0, script);
  const RunOutput on = RunScript(GetParam(), PrefixCaching::kOn, 0, script);
  ExpectSame(on, off, GetParam());
  int computed_on = 0, computed_off = 0;
  for (size_t i = 0; i < on.unpadded_tokens.size(); ++i) {
    computed_on += on.unpadded_tokens[i];
    computed_off += off.unpadded_tokens[i];
  }
  EXPECT_LT(computed_on, computed_off);
}

INSTANTIATE_TEST_SUITE_P(Modes, PrefixCacheRunnerTest,
                         ::testing::Values("NONE", "PIECEWISE", "FULL",
                                           "FULL_DECODE_ONLY",
                                           "FULL_AND_PIECEWISE"));

// Qwen3's cached blocks hold k after its q/k norm and RoPE: a hit reuses
// them as they are, so the outputs are the uncached run's bits.
TEST(PrefixCacheRunnerFamilyTest, Qwen3SameOutputsAsWithoutCaching) {
  const std::vector<ScriptStep> script = Script();
  for (const char* mode : {"NONE", "FULL_AND_PIECEWISE"}) {
    const RunOutput off =
        RunScript(mode, PrefixCaching::kOff, 0, script, TinyShape::kQwen3);
    const RunOutput on =
        RunScript(mode, PrefixCaching::kOn, 0, script, TinyShape::kQwen3);
    ExpectSame(on, off, mode);
  }
}

// A KV cache of a few dozen blocks: distinct prompts evict the cached ones
// (tail blocks first), and what is still cached gives the same outputs.
TEST(PrefixCacheRunnerEvictionTest, SameOutputsAfterEvictions) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  ASSERT_TRUE(dir.ok());
  CpuDevice device;
  ModelRunnerOptions probe = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  int64_t bytes_per_block = 0;
  {
    auto r = ModelRunner::Create(device, *dir, probe);
    ASSERT_TRUE(r.ok()) << r.status();
    bytes_per_block =
        probe.kv_cache_bytes / (*r)->kv_cache().Stats().total_blocks;
  }
  const int64_t bytes = bytes_per_block * 40;
  std::vector<ScriptStep> script;
  const std::vector<int32_t> sys = Tokens(9, 24);
  script.push_back({{Start("p0", sys)}, {"p0"}, {0}});
  for (int k = 1; k <= 6; ++k) {
    // 6 prompts of 24 tokens (6 blocks each) through a 40-block cache.
    script.push_back({{Start("x" + std::to_string(k), Tokens(100 + k, 24))},
                      {"x" + std::to_string(k)},
                      {0}});
  }
  // Whatever of sys survived: at most its first blocks (LRU evicts the
  // least recently freed, tail first). The expected count is read from a
  // run with caching on below, then checked against the rule.
  script.push_back({{Start("p1", Join(sys, {1, 2, 3}))}, {}, {0}});
  // Learn how many blocks of sys survive: the on-run's row says.
  auto dir2 = TinyModelDir(TinyShape::kGqa);
  ModelRunnerOptions options = SmallOptions(R"({"cudagraph_mode":"NONE"})");
  options.kv_cache_bytes = bytes;
  options.prefix_caching = PrefixCaching::kOn;
  auto r = ModelRunner::Create(device, *dir2, options);
  ASSERT_TRUE(r.ok()) << r.status();
  const int32_t total = (*r)->kv_cache().Stats().total_blocks;
  ASSERT_GE(total, 30);
  ASSERT_LT(total, 6 * 6 + 6);  // the prompts do not all fit
  int32_t cached_last = -1;
  for (const ScriptStep& step : script) {
    auto result = (*r)->Execute(step.batch);
    ASSERT_TRUE(result.ok()) << result.status();
    cached_last = result->sequences[0].cached_tokens;
    for (const std::string& id : step.release_after) {
      ASSERT_TRUE((*r)->Release(id).ok());
    }
  }
  EXPECT_GT((*r)->kv_cache().Stats().evictions, 0);
  // 7 prompts x 6 blocks = 42 blocks were written into `total`: the oldest
  // (sys's) are evicted first, its tail before its head.
  const int32_t evicted = 7 * 6 - total;
  EXPECT_EQ(cached_last, std::max(0, 6 - evicted) * kBs);
  script.back().cached = {cached_last};
  const RunOutput off = RunScript("NONE", PrefixCaching::kOff, bytes, script);
  const RunOutput on = RunScript("NONE", PrefixCaching::kOn, bytes, script);
  ExpectSame(on, off, "evictions");
}

}  // namespace
}  // namespace pdworker
