// tools/logits_probe, the pdworker side of the comparison against Hugging
// Face transformers (bench/torch_compare/hf_compare.py), run as a binary on
// the CPU backend: its logits files and greedy tokens against the
// independent numpy reference (tests/reference/llama_reference.py), graph
// modes against eager, and bad inputs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/command.h"
#include "tests/model/reference_runner.h"
#include "tests/model/test_paths.h"
#include "tests/model/tiny_model_maker.h"

namespace pdworker {
namespace {

using model_testing::RunCommand;
using model_testing::RunfilePath;
using model_testing::ShellQuote;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// fp32 CPU kernels vs the float64 reference (as in
// model_runner_reference_test): observed ~1e-6.
constexpr float kLogitTolerance = 2e-4f;

struct Npy {
  std::string shape;  // the header's shape tuple, e.g. "(3, 512)"
  std::vector<float> values;
};

// Reads a .npy file as written by tools/logits_probe (v1.0, '<f4', C order),
// checking the parts of the format numpy.load relies on.
Npy ReadNpy(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream buffer;
  buffer << file.rdbuf();
  const std::string bytes = buffer.str();
  Npy npy;
  EXPECT_GE(bytes.size(), 10u) << path;
  if (bytes.size() < 10) return npy;
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_len =
      static_cast<uint8_t>(bytes[8]) | (static_cast<uint8_t>(bytes[9]) << 8);
  const size_t data_start = 10 + header_len;
  EXPECT_EQ(data_start % 64, 0u) << "data must be 64-byte aligned";
  const std::string header = bytes.substr(10, header_len);
  EXPECT_THAT(header, HasSubstr("'descr': '<f4'"));
  EXPECT_THAT(header, HasSubstr("'fortran_order': False"));
  EXPECT_EQ(header.back(), '\n');
  const size_t open = header.find("'shape': (");
  npy.shape = header.substr(open + 9, header.find(')', open) - open - 8);
  npy.values.resize((bytes.size() - data_start) / sizeof(float));
  std::memcpy(npy.values.data(), bytes.data() + data_start,
              npy.values.size() * sizeof(float));
  return npy;
}

std::string ReadText(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

struct ProbeRun {
  Json result;
  Npy prefill;
  Npy decode;
};

std::string ProbeCommand(const std::string& model_dir,
                         const std::string& prompts_path,
                         const std::string& out_dir, const std::string& extra) {
  return absl::StrCat(
      ShellQuote(RunfilePath("tools/logits_probe/logits_probe")),
      " --model_dir=", ShellQuote(model_dir),
      " --prompts=", ShellQuote(prompts_path),
      " --out_dir=", ShellQuote(out_dir), " ", extra);
}

ProbeRun RunProbe(const std::string& model_dir, const Json& prompts,
                  const std::string& flags) {
  const std::string out = model_testing::MakeUniqueTempDir("probe");
  const std::string prompts_path = out + "/prompts.json";
  std::ofstream(prompts_path) << prompts.dump();
  auto run = RunCommand(ProbeCommand(model_dir, prompts_path, out, flags));
  EXPECT_TRUE(run.ok()) << run.status();
  ProbeRun probe;
  if (!run.ok()) return probe;
  probe.result = Json::parse(ReadText(out + "/result.json"));
  probe.prefill = ReadNpy(out + "/prefill_logits.npy");
  probe.decode = ReadNpy(out + "/decode_logits.npy");
  return probe;
}

std::string MakeModel(const std::string& shape) {
  model_testing::TinyModelRequest request;
  request.shape = shape;
  auto dir = model_testing::MakeTinyModel(request);
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : "";
}

float MaxAbsDiff(const float* a, const float* b, size_t n) {
  float worst = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

// Prompts of 6, 1 and 9 tokens; with --max_num_batched_tokens=4 the first
// and last are prefilled in chunks.
const Json kPrompts = {
    {"prompts",
     {{5, 17, 42, 8, 99, 3}, {1}, {150, 9, 44, 21, 33, 8, 2, 10, 11}}}};
constexpr int kSteps = 6;
constexpr int kLogitSteps = 3;

TEST(LogitsProbeTest, LogitsAndGreedyTokensMatchTheReference) {
  const std::string dir = MakeModel("llama3_rope");
  const ProbeRun probe =
      RunProbe(dir, kPrompts,
               absl::StrCat("--mode=FULL --greedy_steps=", kSteps,
                            " --decode_logits_steps=", kLogitSteps,
                            " --max_num_batched_tokens=4"));
  ASSERT_TRUE(probe.result.is_object());
  const int vocab = probe.result["vocab"].get<int>();
  EXPECT_EQ(vocab, 512);
  EXPECT_EQ(probe.result["ran_as"], Json({"FULL"}));
  EXPECT_EQ(probe.prefill.shape, absl::StrCat("(3, ", vocab, ")"));
  EXPECT_EQ(probe.decode.shape,
            absl::StrCat("(3, ", kLogitSteps, ", ", vocab, ")"));
  ASSERT_EQ(probe.prefill.values.size(), 3u * vocab);
  ASSERT_EQ(probe.decode.values.size(), 3u * kLogitSteps * vocab);

  for (size_t p = 0; p < 3; ++p) {
    SCOPED_TRACE(absl::StrCat("prompt ", p));
    const std::vector<int32_t> prompt =
        kPrompts["prompts"][p].get<std::vector<int32_t>>();
    const std::vector<int32_t> greedy =
        probe.result["prompts"][p]["greedy"].get<std::vector<int32_t>>();
    EXPECT_EQ(probe.result["prompts"][p]["prompt"].get<std::vector<int32_t>>(),
              prompt);
    ASSERT_EQ(greedy.size(), static_cast<size_t>(kSteps));
    auto want = model_testing::RunReferenceGreedy(dir, prompt, kSteps);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(greedy, *want);

    // Teacher-forced reference over the probe's own path: row n-1 is the
    // prefill row, row n+k the decode row k.
    std::vector<int32_t> path = prompt;
    path.insert(path.end(), greedy.begin(), greedy.end() - 1);
    auto ref = model_testing::RunReferenceLogits(dir, {path});
    ASSERT_TRUE(ref.ok()) << ref.status();
    const size_t n = prompt.size();
    EXPECT_LE(MaxAbsDiff(&probe.prefill.values[p * vocab],
                         &(*ref)[0][(n - 1) * vocab], vocab),
              kLogitTolerance);
    for (int k = 0; k < kLogitSteps; ++k) {
      EXPECT_LE(MaxAbsDiff(&probe.decode.values[(p * kLogitSteps + k) * vocab],
                           &(*ref)[0][(n + k) * vocab], vocab),
                kLogitTolerance)
          << "decode step " << k;
    }
  }
}

// On the CPU backend every graph mode is bit-identical to eager, so the
// probe's files must be too: a difference means the probe (or a mode) reads
// rows from the wrong place.
TEST(LogitsProbeTest, GraphModesWriteTheSameBytesAsEager) {
  const std::string dir = MakeModel("gqa");
  const std::string flags = absl::StrCat(
      "--greedy_steps=", kSteps, " --decode_logits_steps=", kLogitSteps);
  const ProbeRun eager = RunProbe(dir, kPrompts, "--mode=NONE " + flags);
  EXPECT_EQ(eager.result["ran_as"], Json({"NONE"}));
  EXPECT_EQ(eager.result["graphs"], 0);
  for (const char* mode : {"FULL", "PIECEWISE", "FULL_AND_PIECEWISE"}) {
    SCOPED_TRACE(mode);
    const ProbeRun graphs =
        RunProbe(dir, kPrompts, absl::StrCat("--mode=", mode, " ", flags));
    EXPECT_GT(graphs.result["graphs"].get<int>(), 0);
    EXPECT_NE(graphs.result["ran_as"], Json({"NONE"}));
    EXPECT_EQ(graphs.prefill.values, eager.prefill.values);
    EXPECT_EQ(graphs.decode.values, eager.decode.values);
    for (size_t p = 0; p < 3; ++p) {
      EXPECT_EQ(graphs.result["prompts"][p]["greedy"],
                eager.result["prompts"][p]["greedy"]);
    }
  }
}

TEST(LogitsProbeTest, BadInputsFailWithAMessage) {
  const std::string dir = MakeModel("gqa");
  const std::string out = model_testing::MakeUniqueTempDir("probe_bad");
  const auto run = [&](const std::string& prompts_text,
                       const std::string& flags) {
    const std::string path = out + "/prompts.json";
    std::ofstream(path) << prompts_text;
    auto result = RunCommand(ProbeCommand(dir, path, out, flags));
    EXPECT_FALSE(result.ok()) << prompts_text << " " << flags;
    return result.ok() ? std::string() : std::string(result.status().message());
  };
  EXPECT_THAT(run(R"({"prompts": [[1, 256]]})", ""),
              HasSubstr("is not an id below 256"));
  EXPECT_THAT(run(R"({"prompts": [[1, -3]]})", ""),
              HasSubstr("is not an id below"));
  EXPECT_THAT(run(R"({"prompts": []})", ""), HasSubstr("expected"));
  EXPECT_THAT(run(R"({"prompts": [[]]})", ""), HasSubstr("non-empty"));
  EXPECT_THAT(run("not json", ""), HasSubstr("parse"));
  EXPECT_THAT(
      run(R"({"prompts": [[1]]})", "--greedy_steps=4 --decode_logits_steps=4"),
      HasSubstr("decode_logits_steps"));
  EXPECT_THAT(run(R"({"prompts": [[1]]})", "--mode=SOMETIMES"),
              HasSubstr("SOMETIMES"));
  EXPECT_THAT(run(R"({"prompts": [[1]]})", "--device=tpu"),
              HasSubstr("--device"));
  // Nothing is written for a failed run.
  std::ifstream result(out + "/result.json");
  EXPECT_FALSE(result.good());
}

}  // namespace
}  // namespace pdworker
