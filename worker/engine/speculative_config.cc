#include "worker/engine/speculative_config.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdworker {
namespace {

constexpr char kPrefix[] = "speculative_config: ";

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(kPrefix, message));
}

// An optional positive integer key; 0 when absent.
absl::StatusOr<int> PositiveInt(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return 0;
  if (!it->is_number_integer() || it->get<int64_t>() < 1 ||
      it->get<int64_t>() > (int64_t{1} << 20)) {
    return Invalid(
        absl::StrCat(key, " must be a positive integer, got ", it->dump()));
  }
  return static_cast<int>(it->get<int64_t>());
}

}  // namespace

absl::StatusOr<SpeculativeConfig> ParseSpeculativeConfig(
    absl::string_view json) {
  SpeculativeConfig config;
  if (json.empty()) return config;
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr,
                            /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Invalid("not a JSON object");
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "method" && key != "model" && key != "num_speculative_tokens" &&
        key != "prompt_lookup_min" && key != "prompt_lookup_max" &&
        key != "disable_by_batch_size") {
      return Invalid(absl::StrCat(
          "unsupported key \"", key,
          "\" (supported: method, model, num_speculative_tokens, "
          "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)"));
    }
  }
  std::string method, model;
  for (const auto& [key, out] :
       {std::pair<const char*, std::string*>{"method", &method},
        {"model", &model}}) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string())
      return Invalid(absl::StrCat(key, " must be a string"));
    *out = it->get<std::string>();
  }
  const bool ngram_model = model == "ngram" || model == "[ngram]";
  if (method.empty() && ngram_model) method = "ngram";
  if (method == "[ngram]") method = "ngram";
  if (method.empty()) {
    if (model.empty()) return Invalid("method is missing");
    return absl::UnimplementedError(
        absl::StrCat(kPrefix, "a draft model (model \"", model,
                     "\") is not supported yet; method \"ngram\" is"));
  }
  if (method != "ngram") {
    return absl::UnimplementedError(
        absl::StrCat(kPrefix, "method \"", method,
                     "\" is not supported yet; method \"ngram\" is"));
  }
  if (!model.empty() && !ngram_model) {
    return Invalid(absl::StrCat("model \"", model,
                                "\" with method \"ngram\" (which has no "
                                "model; leave it out)"));
  }
  config.method = SpeculativeMethod::kNgram;
  absl::StatusOr<int> k = PositiveInt(j, "num_speculative_tokens");
  if (!k.ok()) return k.status();
  if (*k == 0) return Invalid("num_speculative_tokens is required");
  config.num_speculative_tokens = *k;
  absl::StatusOr<int> lo = PositiveInt(j, "prompt_lookup_min");
  if (!lo.ok()) return lo.status();
  absl::StatusOr<int> hi = PositiveInt(j, "prompt_lookup_max");
  if (!hi.ok()) return hi.status();
  if (*lo == 0 && *hi == 0) {
    config.prompt_lookup_min = config.prompt_lookup_max = 5;
  } else {
    config.prompt_lookup_min = *lo == 0 ? *hi : *lo;
    config.prompt_lookup_max = *hi == 0 ? *lo : *hi;
  }
  if (config.prompt_lookup_min > config.prompt_lookup_max) {
    return Invalid(absl::StrCat("prompt_lookup_min (", config.prompt_lookup_min,
                                ") exceeds prompt_lookup_max (",
                                config.prompt_lookup_max, ")"));
  }
  absl::StatusOr<int> batch = PositiveInt(j, "disable_by_batch_size");
  if (!batch.ok()) return batch.status();
  config.disable_by_batch_size = *batch;
  return config;
}

}  // namespace pdworker
