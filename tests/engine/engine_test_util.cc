#include "tests/engine/engine_test_util.h"

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dispatcher/compilation_config.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "prometheus/text_serializer.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace pdworker::engine_testing {

std::string ModelDir(const ModelDirOptions& options) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string name =
      absl::StrCat("tiny_gqa_engine_", options.max_position_embeddings);
  if (options.generation_eos_ids.has_value()) {
    absl::StrAppend(&name, "_eos_",
                    absl::StrJoin(*options.generation_eos_ids, "_"));
  }
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  TinyModelOptions tiny;
  tiny.shape = TinyShape::kGqa;
  tiny.seed = 7;
  const absl::Status written = WriteTinyModel(tiny, dir);
  CHECK(written.ok()) << written;
  if (options.max_position_embeddings > 0) {
    std::ifstream in(dir + "/config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["max_position_embeddings"] = options.max_position_embeddings;
    std::ofstream(dir + "/config.json") << config.dump(2);
  }
  std::filesystem::remove(dir + "/generation_config.json");
  if (options.generation_eos_ids.has_value()) {
    nlohmann::json generation;
    generation["eos_token_id"] = *options.generation_eos_ids;
    std::ofstream(dir + "/generation_config.json") << generation.dump(2);
  }
  return dir;
}

ModelRunnerOptions SmallOptions(const std::string& mode) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 64;
  o.kv_cache_bytes = int64_t{1} << 20;
  o.block_size = 4;
  o.max_model_len = 128;
  o.input_address_check = InputAddressCheck::kOn;
  auto config = ParseCompilationConfig(
      absl::StrCat(R"({"cudagraph_mode":")", mode,
                   R"(","cudagraph_capture_sizes":[1,2,4,8,16]})"));
  CHECK(config.ok()) << config.status();
  o.compilation = *config;
  return o;
}

std::vector<std::string> AllModes() {
  return {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
          "FULL_AND_PIECEWISE"};
}

std::unique_ptr<TestEngine> StartEngine(const std::string& model_dir,
                                        const ModelRunnerOptions& options,
                                        const EngineOptions& engine_options,
                                        CpuStreamExecution execution) {
  auto t = std::make_unique<TestEngine>();
  CpuDeviceOptions device_options;
  device_options.stream_execution = execution;
  t->device = std::make_unique<CpuDevice>(device_options);
  auto runner = ModelRunner::Create(*t->device, model_dir, options);
  CHECK(runner.ok()) << runner.status();
  t->runner = *std::move(runner);
  WorkerMetricsOptions metrics_options;
  metrics_options.cache.block_size = t->runner->kv_cache().block_size();
  metrics_options.cache.num_blocks = t->runner->kv_cache().Stats().total_blocks;
  WorkerInfo info;
  info.role = "both";
  t->metrics = std::make_unique<WorkerMetrics>(
      info, &t->runner->graph_stats(),
      GraphStatsHeader{t->runner->resolved_mode(),
                       t->runner->dispatcher().capture_sizes()},
      metrics_options);
  t->engine =
      std::make_unique<Engine>(*t->runner, engine_options, t->metrics.get());
  const absl::Status captured =
      t->engine->RunExclusive([](ModelRunner& r) -> absl::Status {
        return r.CaptureGraphs().status();
      });
  CHECK(captured.ok()) << captured;
  return t;
}

std::string TestEngine::MetricsText() const {
  const std::vector<prometheus::MetricFamily> families =
      metrics->registry()->Collect();
  return prometheus::TextSerializer().Serialize(families);
}

PendingGeneration::PendingGeneration(Engine& engine, RequestSpec spec,
                                     std::shared_ptr<CallControl> control) {
  auto request = std::make_unique<EngineRequest>();
  request->spec = std::move(spec);
  request->control = std::move(control);
  request->on_update = [this](const RequestUpdate& u) {
    std::lock_guard<std::mutex> lock(mu_);
    ++result_.updates;
    result_.cached_tokens = u.num_cached_tokens;
    for (size_t i = 0; i < u.new_token_ids.size(); ++i) {
      result_.tokens.push_back(u.new_token_ids[i]);
      result_.logprobs.push_back(u.new_logprobs[i]);
      result_.token_steps.push_back(u.step);
    }
    result_.token_logprobs.insert(result_.token_logprobs.end(),
                                  u.new_token_logprobs.begin(),
                                  u.new_token_logprobs.end());
    if (u.last()) {
      result_.finish_reason = u.finish_reason;
      result_.matched_token_id = u.matched_token_id;
      // A fresh copy, not a shared reference: absl::Status counts
      // references in Debian's uninstrumented abseil, so TSan would not
      // see the test thread's release of a shared one before the engine
      // thread frees it.
      result_.status = absl::Status(u.status.code(), u.status.message());
      done_ = true;
      done_cv_.notify_all();
    }
  };
  engine.Submit(std::move(request));
}

Generation PendingGeneration::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return done_; });
  return result_;
}

int PendingGeneration::TokensSoFar() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(result_.tokens.size());
}

RequestSpec Spec(const std::string& id, std::vector<int32_t> prompt,
                 int32_t max_tokens, SamplingOptions sampling) {
  RequestSpec spec;
  spec.request_id = id;
  spec.prompt = std::move(prompt);
  spec.sampling = sampling;
  spec.stop.max_tokens = max_tokens;
  spec.stop.eos = EosHandling::kIgnore;
  return spec;
}

absl::StatusOr<Sampled> ReferenceGeneration(ModelRunner& runner,
                                            const std::string& id,
                                            const std::vector<int32_t>& prompt,
                                            int num_tokens,
                                            const SamplingOptions& sampling,
                                            const std::vector<int32_t>& banned,
                                            int ban_until) {
  Sampled out;
  const int chunk = runner.options().max_num_batched_tokens;
  std::vector<int32_t> next;
  for (size_t start = 0; start < prompt.size(); start += chunk) {
    const size_t end = std::min(prompt.size(), start + chunk);
    SequenceStep step;
    step.sequence_id = id;
    step.token_ids.assign(prompt.begin() + start, prompt.begin() + end);
    step.sampling = sampling;
    step.creation = start == 0 ? SequenceCreation::kMustBeNew
                               : SequenceCreation::kMustExist;
    if (end == prompt.size() && ban_until > 0) step.banned_token_ids = banned;
    absl::StatusOr<StepResult> result = runner.Execute({&step, 1});
    if (!result.ok()) return result.status();
    if (end == prompt.size()) {
      out.tokens.push_back(result->sequences[0].token_id);
      out.logprobs.push_back(result->sequences[0].logprob);
    }
  }
  while (static_cast<int>(out.tokens.size()) < num_tokens) {
    SequenceStep step;
    step.sequence_id = id;
    step.token_ids = {out.tokens.back()};
    step.sampling = sampling;
    step.creation = SequenceCreation::kMustExist;
    if (static_cast<int>(out.tokens.size()) < ban_until) {
      step.banned_token_ids = banned;
    }
    absl::StatusOr<StepResult> result = runner.Execute({&step, 1});
    if (!result.ok()) return result.status();
    out.tokens.push_back(result->sequences[0].token_id);
    out.logprobs.push_back(result->sequences[0].logprob);
  }
  absl::Status released = runner.Release(id);
  if (!released.ok()) return released;
  return out;
}

std::vector<int32_t> Prompt(int length, uint64_t seed) {
  std::vector<int32_t> tokens(length);
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (int i = 0; i < length; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    tokens[i] = 3 + static_cast<int32_t>(x % 253);
  }
  return tokens;
}

namespace {

// One value handed from the engine thread to the test thread. Not
// std::promise: TSan does not model libstdc++'s futex-based future wait.
// Set notifies under the lock, so the waiter cannot destroy this while the
// engine thread still touches it.
template <typename T>
class OneValue {
 public:
  void Set(T value) {
    std::lock_guard<std::mutex> lock(mu_);
    value_ = std::move(value);
    cv_.notify_all();
  }
  T Get() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return value_.has_value(); });
    return *std::move(value_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<T> value_;
};

}  // namespace

absl::StatusOr<AbortOutcome> Abort(Engine& engine,
                                   std::vector<std::string> ids) {
  OneValue<absl::StatusOr<AbortOutcome>> result;
  auto call = std::make_unique<AbortCall>();
  call->request_ids = std::move(ids);
  call->done = [&result](const absl::StatusOr<AbortOutcome>& outcome) {
    result.Set(outcome);
  };
  engine.Submit(std::move(call));
  return result.Get();
}

absl::StatusOr<ForwardOutcome> Forward(Engine& engine, const std::string& id,
                                       std::vector<int32_t> tokens,
                                       SequenceCreation creation,
                                       AfterStep after) {
  OneValue<absl::StatusOr<ForwardOutcome>> result;
  auto call = std::make_unique<ForwardCall>();
  call->spec.total_tokens = static_cast<int64_t>(tokens.size());
  call->spec.sequences.push_back(
      MakeSequenceStep(id, std::move(tokens), creation));
  call->spec.after_step.push_back(after);
  call->control = std::make_shared<CallControl>();
  call->done = [&result](const absl::StatusOr<ForwardOutcome>& outcome) {
    result.Set(outcome);
  };
  engine.Submit(std::move(call));
  return result.Get();
}

}  // namespace pdworker::engine_testing
