// logits_probe: runs prompts through pdworker's ModelRunner on one device in
// one graph mode and writes what a comparison against another implementation
// (Hugging Face transformers, bench/torch_compare/hf_compare.py; or the numpy
// reference) needs: the logits after each prompt, the logits of the first
// decode steps, and the greedy continuation.
//
//   logits_probe --model_dir=DIR --device=cuda --mode=FULL
//       --prompts=prompts.json --greedy_steps=64 --decode_logits_steps=4
//       --out_dir=OUT
//
// prompts.json: {"prompts": [[token ids], ...]}.
// Each prompt is prefilled in its own steps (chunked to
// --max_num_batched_tokens), then all prompts decode together, one batch of
// P sequences per step, greedy (temperature 0), so decode steps run as the
// mode's graphs would serve them (P padded up to a capture size).
//
// Writes into --out_dir:
//   result.json          {"mode", "ran_as" (runtime modes of the decode
//                        steps), "device", "vocab", "greedy_steps",
//                        "decode_logits_steps", "capture_seconds", "graphs",
//                        "prompts": [{"prompt": [...], "greedy": [...]}]}
//   prefill_logits.npy   float32 [P, vocab]: logits after the whole prompt p
//                        (they predict greedy[0])
//   decode_logits.npy    float32 [P, K, vocab]: logits after feeding
//                        greedy[k] (they predict greedy[k + 1]), k < K
// Exit status 0 on success; 1 with the error on stderr.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "tools/logits_probe/npy_writer.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"

ABSL_FLAG(std::string, model_dir, "", "Hugging Face checkpoint directory.");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda.");
ABSL_FLAG(std::string, mode, "NONE",
          "cudagraph_mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, "
          "FULL_AND_PIECEWISE.");
ABSL_FLAG(std::string, prompts, "", "JSON file {\"prompts\": [[ids], ...]}.");
ABSL_FLAG(int, greedy_steps, 64, "Greedy tokens generated per prompt.");
ABSL_FLAG(int, decode_logits_steps, 4,
          "Decode steps whose logits are written (<= greedy_steps - 1).");
ABSL_FLAG(int, max_num_batched_tokens, 2048, "Prefill chunk size, tokens.");
ABSL_FLAG(std::string, out_dir, "", "Output directory (must exist).");

namespace pdworker {
namespace {

using Json = nlohmann::json;

absl::StatusOr<std::vector<std::vector<int32_t>>> ReadPrompts(
    const std::string& path, int64_t vocab) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  Json root;
  try {
    root = Json::parse(file);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  if (!root.is_object() || !root.contains("prompts") ||
      !root["prompts"].is_array() || root["prompts"].empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected {\"prompts\": [[ids], ...]}"));
  }
  std::vector<std::vector<int32_t>> prompts;
  for (const Json& prompt : root["prompts"]) {
    if (!prompt.is_array() || prompt.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": every prompt must be a non-empty list"));
    }
    std::vector<int32_t> ids;
    for (const Json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": token ", id.dump(), " is not an id below ", vocab));
      }
      ids.push_back(id.get<int32_t>());
    }
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

struct ProbeOutput {
  std::vector<std::vector<int32_t>> greedy;  // [P][greedy_steps]
  std::vector<float> prefill_logits;         // [P, vocab]
  std::vector<float> decode_logits;          // [P, K, vocab]
  std::set<std::string> ran_as;              // decode steps' runtime modes
};

absl::StatusOr<ProbeOutput> Probe(
    ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
    int steps, int logits_steps) {
  const size_t vocab = static_cast<size_t>(runner.model_config().vocab_size);
  const int chunk = runner.options().max_num_batched_tokens;
  const size_t num_prompts = prompts.size();
  ProbeOutput out;
  out.greedy.resize(num_prompts);
  out.prefill_logits.resize(num_prompts * vocab);
  out.decode_logits.resize(num_prompts * logits_steps * vocab);
  std::vector<float> rows;
  for (size_t p = 0; p < num_prompts; ++p) {
    const std::string id = absl::StrCat("p", p);
    for (size_t start = 0; start < prompts[p].size(); start += chunk) {
      const size_t end = std::min(prompts[p].size(), start + chunk);
      std::vector<int32_t> part(prompts[p].begin() + start,
                                prompts[p].begin() + end);
      const SequenceStep step =
          MakeSequenceStep(id, std::move(part),
                           start == 0 ? SequenceCreation::kMustBeNew
                                      : SequenceCreation::kMustExist);
      PDW_ASSIGN_OR_RETURN(StepResult result, runner.Execute({&step, 1}));
      if (end == prompts[p].size()) {
        out.greedy[p].push_back(result.sequences[0].token_id);
        PDW_RETURN_IF_ERROR(runner.ReadLogits(1, &rows));
        std::copy(rows.begin(), rows.end(),
                  out.prefill_logits.begin() + p * vocab);
      }
    }
  }
  for (int k = 0; k + 1 < steps; ++k) {
    std::vector<SequenceStep> batch;
    for (size_t p = 0; p < num_prompts; ++p) {
      batch.push_back(MakeSequenceStep(absl::StrCat("p", p),
                                       {out.greedy[p].back()},
                                       SequenceCreation::kMustExist));
    }
    PDW_ASSIGN_OR_RETURN(StepResult result, runner.Execute(batch));
    out.ran_as.insert(std::string(RuntimeModeName(result.info.mode)));
    for (size_t p = 0; p < num_prompts; ++p) {
      out.greedy[p].push_back(result.sequences[p].token_id);
    }
    if (k < logits_steps) {
      PDW_RETURN_IF_ERROR(
          runner.ReadLogits(static_cast<int>(num_prompts), &rows));
      for (size_t p = 0; p < num_prompts; ++p) {
        std::copy(rows.begin() + p * vocab, rows.begin() + (p + 1) * vocab,
                  out.decode_logits.begin() + (p * logits_steps + k) * vocab);
      }
    }
  }
  for (size_t p = 0; p < num_prompts; ++p) {
    PDW_RETURN_IF_ERROR(runner.Release(absl::StrCat("p", p)));
  }
  return out;
}

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  const std::string out_dir = absl::GetFlag(FLAGS_out_dir);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const int steps = absl::GetFlag(FLAGS_greedy_steps);
  const int logits_steps = absl::GetFlag(FLAGS_decode_logits_steps);
  if (model_dir.empty() || out_dir.empty() ||
      absl::GetFlag(FLAGS_prompts).empty()) {
    return absl::InvalidArgumentError(
        "--model_dir, --prompts and --out_dir are required");
  }
  if (steps < 1 || logits_steps < 0 || logits_steps > steps - 1) {
    return absl::InvalidArgumentError(
        "need --greedy_steps >= 1 and 0 <= --decode_logits_steps < "
        "--greedy_steps");
  }
  const std::string device_name = absl::GetFlag(FLAGS_device);
  if (device_name != "cpu" && device_name != "cuda") {
    return absl::InvalidArgumentError("--device must be cpu or cuda");
  }
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                       CreateDevice(device_name == "cuda" ? DeviceKind::kCuda
                                                          : DeviceKind::kCpu));
  PDW_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  PDW_ASSIGN_OR_RETURN(auto prompts, ReadPrompts(absl::GetFlag(FLAGS_prompts),
                                                 config.vocab_size));
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());

  ModelRunnerOptions options;
  options.role = Role::kBoth;
  options.max_num_seqs = std::max<int>(8, static_cast<int>(prompts.size()));
  options.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  options.max_model_len = static_cast<int>(longest) + steps + 16;
  // K and V for every layer, 4 bytes per element covers fp32 and bf16 caches,
  // plus a block per sequence of rounding.
  const int64_t per_token = 2 * config.num_hidden_layers * config.kv_size() * 4;
  options.kv_cache_bytes = per_token *
                           (options.max_model_len + options.block_size) *
                           static_cast<int64_t>(prompts.size());
  PDW_ASSIGN_OR_RETURN(options.compilation,
                       ParseCompilationConfig(absl::StrCat(
                           R"({"cudagraph_mode":")", mode, R"("})")));
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                       ModelRunner::Create(*device, model_dir, options));
  PDW_ASSIGN_OR_RETURN(CaptureSummary capture, runner->CaptureGraphs());
  PDW_ASSIGN_OR_RETURN(ProbeOutput out,
                       Probe(*runner, prompts, steps, logits_steps));

  const int64_t num_prompts = static_cast<int64_t>(prompts.size());
  PDW_RETURN_IF_ERROR(
      WriteNpyFloat32(absl::StrCat(out_dir, "/prefill_logits.npy"),
                      {num_prompts, config.vocab_size}, out.prefill_logits));
  PDW_RETURN_IF_ERROR(WriteNpyFloat32(
      absl::StrCat(out_dir, "/decode_logits.npy"),
      {num_prompts, logits_steps, config.vocab_size}, out.decode_logits));
  Json result = {{"mode", mode},
                 {"resolved_mode", runner->resolved_mode().ToString()},
                 {"ran_as", out.ran_as},
                 {"device", device->name()},
                 {"vocab", config.vocab_size},
                 {"greedy_steps", steps},
                 {"decode_logits_steps", logits_steps},
                 {"capture_seconds", capture.total_seconds},
                 {"graphs", runner->NumCapturedGraphs()},
                 {"prompts", Json::array()}};
  for (size_t p = 0; p < prompts.size(); ++p) {
    result["prompts"].push_back(
        {{"prompt", prompts[p]}, {"greedy", out.greedy[p]}});
  }
  const std::string path = absl::StrCat(out_dir, "/result.json");
  std::ofstream file(path);
  file << result.dump() << "\n";
  if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  const absl::Status status = pdworker::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "logits_probe: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
