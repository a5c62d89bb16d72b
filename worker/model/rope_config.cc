#include "worker/model/rope_config.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/config_json.h"

namespace pdworker {
namespace {

using config_json::AsInt;
using config_json::AsNumber;
using config_json::Describe;
using config_json::FieldError;
using config_json::Find;
using config_json::Json;
using config_json::OptionalBool;
using config_json::RequiredInt;
using config_json::RequiredNumber;

// The object's "original_max_position_embeddings" (yarn, longrope), which
// may be absent or null: 0 then (the caller resolves it). `path` ends with
// ".".
absl::StatusOr<int64_t> OptionalOriginalContext(const Json& value,
                                                const std::string& path) {
  const Json* v = Find(value, "original_max_position_embeddings");
  if (v == nullptr || v->is_null()) return 0;
  PDW_ASSIGN_OR_RETURN(
      const int64_t original,
      RequiredInt(value, "original_max_position_embeddings", path));
  if (original <= 0) {
    return FieldError(path + "original_max_position_embeddings",
                      absl::StrCat("must be positive, got ", original));
  }
  return original;
}

// YaRN (transformers' _compute_yarn_parameters, vLLM's
// YaRNScalingRotaryEmbedding): "factor" is required and is what both use;
// "original_max_position_embeddings" may be absent (ParseModelConfig fills in
// max_position_embeddings, 0 here). `path` ends with ".".
absl::StatusOr<RopeScaling> ParseYarn(const Json& value,
                                      const std::string& path) {
  RopeScaling scaling;
  scaling.type = RopeScalingType::kYarn;
  PDW_ASSIGN_OR_RETURN(scaling.factor, RequiredNumber(value, "factor", path));
  if (!(scaling.factor >= 1)) {
    return FieldError(path + "factor",
                      absl::StrCat("must be at least 1, got ", scaling.factor));
  }
  PDW_ASSIGN_OR_RETURN(scaling.original_max_position_embeddings,
                       OptionalOriginalContext(value, path));
  auto optional_number = [&](const char* field,
                             double fallback) -> absl::StatusOr<double> {
    const Json* v = Find(value, field);
    if (v == nullptr) return fallback;
    return AsNumber(*v, absl::StrCat(path, field));
  };
  PDW_ASSIGN_OR_RETURN(scaling.beta_fast, optional_number("beta_fast", 32));
  PDW_ASSIGN_OR_RETURN(scaling.beta_slow, optional_number("beta_slow", 1));
  if (!(scaling.beta_fast > scaling.beta_slow && scaling.beta_slow > 0)) {
    return FieldError(path + "beta_fast",
                      absl::StrCat("(", scaling.beta_fast,
                                   ") must be greater than beta_slow (",
                                   scaling.beta_slow, "), both positive"));
  }
  if (Find(value, "truncate") != nullptr) {
    PDW_ASSIGN_OR_RETURN(scaling.truncate,
                         OptionalBool(value, "truncate", true));
  }
  // 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1).
  auto get_mscale = [&scaling](double mscale) {
    return scaling.factor <= 1 ? 1.0
                               : 0.1 * mscale * std::log(scaling.factor) + 1.0;
  };
  PDW_ASSIGN_OR_RETURN(const double mscale, optional_number("mscale", 0));
  PDW_ASSIGN_OR_RETURN(const double mscale_all_dim,
                       optional_number("mscale_all_dim", 0));
  if (const Json* factor = Find(value, "attention_factor"); factor != nullptr) {
    PDW_ASSIGN_OR_RETURN(scaling.attention_factor,
                         AsNumber(*factor, path + "attention_factor"));
  } else if (mscale != 0 && mscale_all_dim != 0) {
    scaling.attention_factor = get_mscale(mscale) / get_mscale(mscale_all_dim);
  } else {
    scaling.attention_factor = get_mscale(1);
  }
  if (!(scaling.attention_factor > 0) || std::isinf(scaling.attention_factor)) {
    return FieldError(path + "attention_factor",
                      absl::StrCat("must be positive and finite, got ",
                                   scaling.attention_factor));
  }
  return scaling;
}

// LongRoPE (transformers' _compute_longrope_parameters, vLLM's
// Phi3LongRoPEScaledRotaryEmbedding; "su" is its older name): the two factor
// lists, and what the caller resolves against the config's lengths (the
// original context and the attention factor, 0 here when absent).
absl::StatusOr<RopeScaling> ParseLongrope(const Json& value,
                                          const std::string& path) {
  RopeScaling scaling;
  scaling.type = RopeScalingType::kLongrope;
  // Phi-3.5-MoE's per-list scales: its family is refused anyway (MoE), and
  // transformers' dense Phi-3 does not read them.
  for (const char* key : {"short_mscale", "long_mscale"}) {
    if (const Json* v = Find(value, key); v != nullptr && !v->is_null()) {
      return FieldError(path + key,
                        "is not supported (dense Phi-3 models "
                        "do not set it)");
    }
  }
  auto factors = [&](const char* key,
                     std::vector<double>* out) -> absl::Status {
    const Json* list = Find(value, key);
    if (list == nullptr) return FieldError(path + key, "is missing");
    if (!list->is_array() || list->empty()) {
      return FieldError(path + key, absl::StrCat("must be a list of numbers, "
                                                 "got ",
                                                 Describe(*list)));
    }
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string field = absl::StrCat(path, key, "[", i, "]");
      PDW_ASSIGN_OR_RETURN(const double f, AsNumber((*list)[i], field));
      if (!(f > 0) || std::isinf(f)) {
        return FieldError(field,
                          absl::StrCat("must be positive and finite, got ", f));
      }
      out->push_back(f);
    }
    return absl::OkStatus();
  };
  PDW_RETURN_IF_ERROR(factors("short_factor", &scaling.short_factor));
  PDW_RETURN_IF_ERROR(factors("long_factor", &scaling.long_factor));
  if (scaling.short_factor.size() != scaling.long_factor.size()) {
    return FieldError(
        path + "long_factor",
        absl::StrCat("has ", scaling.long_factor.size(),
                     " entries, short_factor ", scaling.short_factor.size()));
  }
  PDW_ASSIGN_OR_RETURN(scaling.original_max_position_embeddings,
                       OptionalOriginalContext(value, path));
  if (const Json* v = Find(value, "factor"); v != nullptr && !v->is_null()) {
    PDW_ASSIGN_OR_RETURN(scaling.factor, AsNumber(*v, path + "factor"));
    if (!(scaling.factor > 0)) {
      return FieldError(path + "factor",
                        absl::StrCat("must be positive, got ", scaling.factor));
    }
  }
  scaling.attention_factor = 0;  // resolved by ResolveLongrope when absent
  if (const Json* v = Find(value, "attention_factor");
      v != nullptr && !v->is_null()) {
    PDW_ASSIGN_OR_RETURN(scaling.attention_factor,
                         AsNumber(*v, path + "attention_factor"));
    if (!(scaling.attention_factor > 0) ||
        std::isinf(scaling.attention_factor)) {
      return FieldError(path + "attention_factor",
                        absl::StrCat("must be positive and finite, got ",
                                     scaling.attention_factor));
    }
  }
  return scaling;
}

// LongRoPE's lengths, as transformers resolves them: the original context
// is the object's key, else config.json's top-level one (Phi-3 writes it
// there), and then the attention factor's scale is max_position_embeddings
// over it; without either, the original context is max_position_embeddings
// and the scale the object's "factor" (default 1).
absl::Status ResolveLongrope(const Json& root, ModelConfig* config) {
  RopeScaling& s = config->rope_scaling;
  const int64_t max_positions = config->max_position_embeddings;
  double scale = s.factor > 0 ? s.factor : 1.0;
  if (s.original_max_position_embeddings == 0) {
    if (const Json* v = Find(root, "original_max_position_embeddings");
        v != nullptr && !v->is_null()) {
      PDW_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                           AsInt(*v, "original_max_position_embeddings"));
      if (s.original_max_position_embeddings <= 0) {
        return FieldError("original_max_position_embeddings",
                          absl::StrCat("must be positive, got ",
                                       s.original_max_position_embeddings));
      }
    }
  }
  if (s.original_max_position_embeddings > 0) {
    scale = static_cast<double>(max_positions) /
            static_cast<double>(s.original_max_position_embeddings);
  } else {
    s.original_max_position_embeddings = max_positions;
  }
  if (s.attention_factor == 0) {
    s.attention_factor =
        scale <= 1
            ? 1.0
            : std::sqrt(1 + std::log(scale) /
                                std::log(static_cast<double>(
                                    s.original_max_position_embeddings)));
  }
  return absl::OkStatus();
}

// The scaling described by one RoPE object: transformers < 5's
// "rope_scaling" or transformers 5's "rope_parameters" (which also holds
// rope_theta, read by the caller). `name` is the field, for errors.
absl::StatusOr<RopeScaling> ParseRopeObject(const Json& value,
                                            const std::string& name) {
  RopeScaling scaling;
  // transformers >= 4.45 writes "rope_type"; older configs write "type".
  std::string type_field = "rope_type";
  const Json* type = Find(value, type_field);
  if (type == nullptr) {
    type_field = "type";
    type = Find(value, type_field);
  }
  const std::string type_name = absl::StrCat(name, ".", type_field);
  if (type == nullptr) {
    return FieldError(absl::StrCat(name, ".rope_type"), "is missing");
  }
  if (!type->is_string()) {
    return FieldError(type_name,
                      absl::StrCat("must be a string, got ", Describe(*type)));
  }
  const std::string kind = type->get<std::string>();
  if (kind == "default") return scaling;  // HF's name for "no scaling"
  const std::string path = absl::StrCat(name, ".");
  auto positive = [&path](absl::string_view field,
                          double value) -> absl::Status {
    if (value > 0) return absl::OkStatus();
    return FieldError(absl::StrCat(path, field),
                      absl::StrCat("must be positive, got ", value));
  };
  if (kind == "linear") {
    scaling.type = RopeScalingType::kLinear;
    PDW_ASSIGN_OR_RETURN(scaling.factor, RequiredNumber(value, "factor", path));
    PDW_RETURN_IF_ERROR(positive("factor", scaling.factor));
    return scaling;
  }
  if (kind == "yarn") return ParseYarn(value, path);
  if (kind == "longrope" || kind == "su") return ParseLongrope(value, path);
  if (kind == "dynamic") {
    scaling.type = RopeScalingType::kDynamic;
    PDW_ASSIGN_OR_RETURN(scaling.factor, RequiredNumber(value, "factor", path));
    if (!(scaling.factor >= 1)) {
      return FieldError(
          path + "factor",
          absl::StrCat("must be at least 1, got ", scaling.factor));
    }
    return scaling;
  }
  if (kind != "llama3") {
    return FieldError(type_name,
                      absl::StrCat("\"", kind,
                                   "\" is not supported; supported: default, "
                                   "llama3, linear, yarn, dynamic, longrope"));
  }
  scaling.type = RopeScalingType::kLlama3;
  auto factor = RequiredNumber(value, "factor", path);
  if (!factor.ok()) return factor.status();
  auto low = RequiredNumber(value, "low_freq_factor", path);
  if (!low.ok()) return low.status();
  auto high = RequiredNumber(value, "high_freq_factor", path);
  if (!high.ok()) return high.status();
  auto original = RequiredInt(value, "original_max_position_embeddings", path);
  if (!original.ok()) return original.status();
  scaling.factor = *factor;
  scaling.low_freq_factor = *low;
  scaling.high_freq_factor = *high;
  scaling.original_max_position_embeddings = *original;
  PDW_RETURN_IF_ERROR(positive("factor", scaling.factor));
  PDW_RETURN_IF_ERROR(positive("low_freq_factor", scaling.low_freq_factor));
  // The smoothing divides by (high - low).
  if (!(scaling.high_freq_factor > scaling.low_freq_factor)) {
    return FieldError(path + "high_freq_factor",
                      absl::StrCat("(", scaling.high_freq_factor,
                                   ") must be greater than low_freq_factor (",
                                   scaling.low_freq_factor, ")"));
  }
  if (scaling.original_max_position_embeddings <= 0) {
    return FieldError(path + "original_max_position_embeddings",
                      absl::StrCat("must be positive, got ",
                                   scaling.original_max_position_embeddings));
  }
  return scaling;
}

bool SameScaling(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type && a.factor == b.factor &&
         a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor &&
         a.original_max_position_embeddings ==
             b.original_max_position_embeddings &&
         a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow &&
         a.truncate == b.truncate && a.attention_factor == b.attention_factor &&
         a.short_factor == b.short_factor && a.long_factor == b.long_factor;
}

}  // namespace

absl::string_view RopeScalingTypeName(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kNone:
      return "default";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kYarn:
      return "yarn";
    case RopeScalingType::kDynamic:
      return "dynamic";
    case RopeScalingType::kLongrope:
      return "longrope";
  }
  return "unknown";
}

namespace {

// RoPE base and scaling. transformers < 5 writes top-level "rope_theta" and
// "rope_scaling"; transformers 5 writes both into "rope_parameters" (and may
// drop or null the old fields). Reading only the old fields from a v5 config
// would silently fall back to theta 10000 and no scaling, giving wrong
// positions with no error, so both layouts are read, and a config whose two
// layouts disagree is refused rather than guessed at.
absl::Status ParseRopeKeys(const Json& root, ModelConfig* config) {
  std::optional<double> legacy_theta;
  if (const Json* theta = Find(root, "rope_theta"); theta != nullptr) {
    auto value = AsNumber(*theta, "rope_theta");
    if (!value.ok()) return value.status();
    legacy_theta = *value;
  }
  std::optional<RopeScaling> legacy_scaling;
  if (const Json* value = Find(root, "rope_scaling"); value != nullptr) {
    if (!value->is_object()) {
      return FieldError(
          "rope_scaling",
          absl::StrCat("must be an object or null, got ", Describe(*value)));
    }
    auto scaling = ParseRopeObject(*value, "rope_scaling");
    if (!scaling.ok()) return scaling.status();
    legacy_scaling = *scaling;
  }
  const Json* params = Find(root, "rope_parameters");
  if (params == nullptr) {
    if (legacy_theta.has_value()) config->rope_theta = *legacy_theta;
    if (legacy_scaling.has_value()) config->rope_scaling = *legacy_scaling;
    return absl::OkStatus();
  }
  if (!params->is_object()) {
    return FieldError(
        "rope_parameters",
        absl::StrCat("must be an object or null, got ", Describe(*params)));
  }
  // Models with several attention types key rope_parameters by layer type
  // ({"full_attention": {...}, "sliding_attention": {...}}; Gemma 3 in
  // transformers 5): the full layers' object is the model's RoPE, and the
  // sliding layers' base, where it differs, is local_rope_theta (plain RoPE
  // only: what Gemma 3's local layers run).
  std::string params_name = "rope_parameters";
  bool per_layer_type = false;
  for (const auto& [key, entry] : params->items()) {
    if (!entry.is_object()) continue;
    per_layer_type = true;
    if (key != "full_attention" && key != "sliding_attention") {
      return FieldError(absl::StrCat("rope_parameters.", key),
                        "is a layer type pdworker does not know; expected "
                        "full_attention and sliding_attention");
    }
  }
  if (per_layer_type) {
    const Json* full = Find(*params, "full_attention");
    if (full == nullptr || !full->is_object()) {
      return FieldError("rope_parameters.full_attention",
                        "is missing (per-layer-type RoPE needs it)");
    }
    if (const Json* sliding = Find(*params, "sliding_attention");
        sliding != nullptr) {
      PDW_ASSIGN_OR_RETURN(
          const RopeScaling local,
          ParseRopeObject(*sliding, "rope_parameters.sliding_attention"));
      if (local.type != RopeScalingType::kNone) {
        return FieldError("rope_parameters.sliding_attention.rope_type",
                          "must be \"default\": sliding layers with scaled "
                          "RoPE are not supported");
      }
      if (const Json* theta = Find(*sliding, "rope_theta"); theta != nullptr) {
        PDW_ASSIGN_OR_RETURN(
            config->local_rope_theta,
            AsNumber(*theta, "rope_parameters.sliding_attention.rope_theta"));
      }
    }
    params = full;
    params_name = "rope_parameters.full_attention";
  }
  auto scaling = ParseRopeObject(*params, params_name);
  if (!scaling.ok()) return scaling.status();
  if (legacy_scaling.has_value() && !SameScaling(*legacy_scaling, *scaling)) {
    return FieldError("rope_scaling",
                      "disagrees with rope_parameters; remove one of them");
  }
  config->rope_scaling = *scaling;
  if (const Json* theta = Find(*params, "rope_theta"); theta != nullptr) {
    auto value = AsNumber(*theta, params_name + ".rope_theta");
    if (!value.ok()) return value.status();
    if (legacy_theta.has_value() && *legacy_theta != *value) {
      return FieldError(
          "rope_theta",
          absl::StrCat("(", *legacy_theta,
                       ") disagrees with rope_parameters.rope_theta (", *value,
                       "); remove one of them"));
    }
    config->rope_theta = *value;
  } else if (legacy_theta.has_value()) {
    config->rope_theta = *legacy_theta;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseRope(const Json& root, ModelConfig* config) {
  PDW_RETURN_IF_ERROR(ParseRopeKeys(root, config));
  if (config->rope_scaling.type == RopeScalingType::kLongrope) {
    PDW_RETURN_IF_ERROR(ResolveLongrope(root, config));
  }
  return absl::OkStatus();
}

}  // namespace pdworker
