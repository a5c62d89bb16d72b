#include "worker/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/fnv1a.h"
#include "common/status_macros.h"
#include "worker/model/config_json.h"
#include "worker/model/model_family.h"
#include "worker/model/rope_config.h"

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

constexpr absl::string_view kPrefix = "config.json: ";

absl::StatusOr<const ModelFamily*> ParseArchitectures(const Json& root) {
  const Json* value = Find(root, "architectures");
  if (value == nullptr) return FieldError("architectures", "is missing");
  if (!value->is_array()) {
    return FieldError(
        "architectures",
        absl::StrCat("must be a list of strings, got ", Describe(*value)));
  }
  std::vector<std::string> found;
  for (const Json& entry : *value) {
    if (!entry.is_string()) {
      return FieldError("architectures",
                        absl::StrCat("must be a list of strings, got element ",
                                     Describe(entry)));
    }
    const std::string name = entry.get<std::string>();
    if (const ModelFamily* family = FindModelFamily(name); family != nullptr) {
      return family;
    }
    found.push_back(name);
  }
  std::vector<absl::string_view> supported;
  for (const ModelFamily* family : ModelFamilies()) {
    supported.push_back(family->architecture_name);
  }
  return FieldError("architectures",
                    absl::StrCat("[", absl::StrJoin(found, ", "),
                                 "] names no supported architecture; "
                                 "supported: ",
                                 absl::StrJoin(supported, ", ")));
}

// "eos_token_id": one id or a list of ids, each >= 0. Errors name the field
// without a file prefix (both config files have it).
absl::StatusOr<std::vector<int64_t>> ParseEosIds(const Json& eos) {
  std::vector<int64_t> ids;
  const auto add = [&ids](const Json& value,
                          absl::string_view field) -> absl::Status {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        (value.is_number_unsigned() &&
         value.get<uint64_t>() >
             static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be a token id (an integer >= 0), got ",
                       Describe(value)));
    }
    ids.push_back(value.get<int64_t>());
    return absl::OkStatus();
  };
  if (eos.is_array()) {
    for (size_t i = 0; i < eos.size(); ++i) {
      absl::Status s = add(eos[i], absl::StrCat("eos_token_id[", i, "]"));
      if (!s.ok()) return s;
    }
  } else {
    absl::Status s = add(eos, "eos_token_id");
    if (!s.ok()) return s;
  }
  return ids;
}

absl::Status ParseTokenIds(const Json& root, ModelConfig* config) {
  if (const Json* bos = Find(root, "bos_token_id"); bos != nullptr) {
    auto id = AsInt(*bos, "bos_token_id");
    if (!id.ok()) return id.status();
    config->bos_token_id = *id;
  }
  if (const Json* pad = Find(root, "pad_token_id"); pad != nullptr) {
    auto id = AsInt(*pad, "pad_token_id");
    if (!id.ok()) return id.status();
    config->pad_token_id = *id;
  }
  if (const Json* eos = Find(root, "eos_token_id"); eos != nullptr) {
    auto ids = ParseEosIds(*eos);
    if (!ids.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kPrefix, ids.status().message()));
    }
    config->eos_token_ids = *std::move(ids);
    config->eos_source = ModelConfig::EosSource::kConfig;
  }
  return absl::OkStatus();
}

// Keys that announce what no family here runs: refused naming the key rather
// than loading tensors the forward would not use (or not finding the ones it
// would).
absl::Status RefuseUnsupportedFeatures(const Json& root) {
  struct Unsupported {
    const char* key;
    const char* what;
  };
  static constexpr Unsupported kUnsupported[] = {
      {"quantization_config", "quantized weights are not supported"},
      {"num_experts", "mixture-of-experts layers are not supported"},
      {"num_local_experts", "mixture-of-experts layers are not supported"},
      {"n_routed_experts", "mixture-of-experts layers are not supported"},
      {"kv_lora_rank", "multi-head latent attention is not supported"},
  };
  for (const Unsupported& u : kUnsupported) {
    if (Find(root, u.key) != nullptr) {
      return FieldError(u.key, absl::StrCat("is set: ", u.what));
    }
  }
  auto mlp_bias = OptionalBool(root, "mlp_bias", false);
  if (!mlp_bias.ok()) return mlp_bias.status();
  if (*mlp_bias) return FieldError("mlp_bias", "= true is not supported");
  return absl::OkStatus();
}

// Phi-4-mini (and GLM, StableLM): RoPE on a leading part of each head only;
// transformers rotates int(head_dim * partial_rotary_factor) values. Then
// LongRoPE's factor lists must have one entry per rotated pair.
absl::Status ResolveRotaryDim(const Json& root, ModelConfig& config) {
  if (const Json* partial = Find(root, "partial_rotary_factor");
      partial != nullptr && !partial->is_null()) {
    PDW_ASSIGN_OR_RETURN(const double factor,
                         AsNumber(*partial, "partial_rotary_factor"));
    const int64_t rotary =
        static_cast<int64_t>(static_cast<double>(config.head_dim) * factor);
    if (!(factor > 0 && factor <= 1) || rotary < 2 || rotary % 2 != 0) {
      return FieldError("partial_rotary_factor",
                        absl::StrCat("(", factor,
                                     ") must be in (0, 1] and rotate an even "
                                     "number of each head's ",
                                     config.head_dim, " values, got ", rotary));
    }
    if (rotary != config.head_dim) config.rotary_dim = rotary;
  }
  const RopeScaling& s = config.rope_scaling;
  const size_t pairs = static_cast<size_t>(config.RotaryDim() / 2);
  if (s.type == RopeScalingType::kLongrope && s.short_factor.size() != pairs) {
    return FieldError("rope_scaling.short_factor",
                      absl::StrCat("has ", s.short_factor.size(),
                                   " entries; the model rotates ", pairs,
                                   " pairs of each head (rotary dim ",
                                   config.RotaryDim(), ")"));
  }
  return absl::OkStatus();
}

// Which layers slide: the family's choice (every layer when it chose none),
// or config.json's "layer_types" (transformers >= 4.54 writes it) where
// present. A window no layer uses is dropped.
absl::Status ResolveSlidingLayers(const Json& root, ModelConfig& config) {
  const size_t layers = static_cast<size_t>(config.num_hidden_layers);
  if (const Json* types = Find(root, "layer_types"); types != nullptr) {
    if (!types->is_array() || types->size() != layers) {
      return FieldError("layer_types",
                        absl::StrCat("must list one entry per layer (", layers,
                                     "), got ", Describe(*types)));
    }
    std::vector<bool> slides;
    for (size_t i = 0; i < layers; ++i) {
      const Json& type = (*types)[i];
      if (type == "sliding_attention") {
        slides.push_back(true);
      } else if (type == "full_attention") {
        slides.push_back(false);
      } else {
        return FieldError(absl::StrCat("layer_types[", i, "]"),
                          absl::StrCat("must be \"sliding_attention\" or "
                                       "\"full_attention\", got ",
                                       Describe(type)));
      }
    }
    const bool any =
        std::find(slides.begin(), slides.end(), true) != slides.end();
    if (any && !config.sliding_window.has_value()) {
      return FieldError("layer_types",
                        "names sliding_attention layers but sliding_window "
                        "is not set");
    }
    config.sliding_layers = std::move(slides);
  }
  if (!config.sliding_window.has_value()) {
    config.sliding_layers.clear();
    return absl::OkStatus();
  }
  if (config.sliding_layers.empty()) config.sliding_layers.assign(layers, true);
  if (std::find(config.sliding_layers.begin(), config.sliding_layers.end(),
                true) == config.sliding_layers.end()) {
    config.sliding_window.reset();
    config.sliding_layers.clear();
  }
  return absl::OkStatus();
}

absl::Status Validate(const ModelConfig& config) {
  const std::pair<absl::string_view, int64_t> positive[] = {
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.num_hidden_layers},
      {"num_attention_heads", config.num_attention_heads},
      {"num_key_value_heads", config.num_key_value_heads},
      {"head_dim", config.head_dim},
      {"vocab_size", config.vocab_size},
      {"max_position_embeddings", config.max_position_embeddings},
  };
  for (const auto& [field, value] : positive) {
    if (value <= 0) {
      return FieldError(field, absl::StrCat("must be positive, got ", value));
    }
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return FieldError(
        "num_attention_heads",
        absl::StrCat("(", config.num_attention_heads,
                     ") must be a multiple of num_key_value_heads (",
                     config.num_key_value_heads, ")"));
  }
  if (config.head_dim % 2 != 0) {
    return FieldError("head_dim",
                      absl::StrCat("(", config.head_dim,
                                   ") must be even: RoPE rotates pairs"));
  }
  if (!(config.rms_norm_eps > 0)) {
    return FieldError("rms_norm_eps", absl::StrCat("must be positive, got ",
                                                   config.rms_norm_eps));
  }
  if (config.local_rope_theta.has_value() && !(*config.local_rope_theta > 0)) {
    return FieldError(
        "rope_local_base_freq",
        absl::StrCat("must be positive, got ", *config.local_rope_theta));
  }
  if (!(config.rope_theta > 0)) {
    return FieldError("rope_theta", absl::StrCat("must be positive, got ",
                                                 config.rope_theta));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view ArchitectureName(Architecture architecture) {
  return FamilyOf(architecture).architecture_name;
}

absl::string_view ModelTypeName(Architecture architecture) {
  return FamilyOf(architecture).model_type;
}

std::string ModelConfig::CanonicalString() const {
  // %.17g round-trips doubles exactly, so equal configs give equal strings.
  std::string text = absl::StrFormat(
      "arch=%s;hidden=%d;intermediate=%d;layers=%d;heads=%d;kv_heads=%d;"
      "head_dim=%d;eps=%.17g;theta=%.17g;vocab=%d;tied=%d;qkv_bias=%d;"
      "o_bias=%d;",
      ArchitectureName(architecture), hidden_size, intermediate_size,
      num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
      rms_norm_eps, rope_theta, vocab_size, tie_word_embeddings ? 1 : 0,
      layer.qkv_bias ? 1 : 0, layer.o_proj_bias ? 1 : 0);
  // Only when set, so the strings (and fingerprints) of the families
  // without it are what they were before the field existed.
  if (layer.qk_norm != QkNorm::kNone) {
    absl::StrAppend(&text, "qk_norm=", QkNormName(layer.qk_norm), ";");
  }
  if (layer.norm_placement == NormPlacement::kSandwich) {
    absl::StrAppend(&text, "sandwich_norms;");
  }
  if (layer.norm_weight == NormWeight::kOnePlus) {
    absl::StrAppend(&text, "norm_one_plus;");
  }
  if (layer.activation != MlpActivation::kSilu) {
    absl::StrAppend(&text, "act=", MlpActivationName(layer.activation), ";");
  }
  if (layer.query_pre_attn_scalar != 0) {
    absl::StrAppendFormat(&text, "query_pre_attn_scalar=%.17g;",
                          layer.query_pre_attn_scalar);
  }
  if (layer.attn_logit_softcapping != 0) {
    absl::StrAppendFormat(&text, "attn_softcap=%.17g;",
                          layer.attn_logit_softcapping);
  }
  if (embedding_multiplier != 1.0) {
    absl::StrAppendFormat(&text, "embed_mult=%.17g;", embedding_multiplier);
  }
  if (final_logit_softcapping != 0) {
    absl::StrAppendFormat(&text, "final_softcap=%.17g;",
                          final_logit_softcapping);
  }
  switch (rope_scaling.type) {
    case RopeScalingType::kNone:
      absl::StrAppend(&text, "rope=none;");
      break;
    case RopeScalingType::kLlama3:
      absl::StrAppendFormat(&text, "rope=llama3,%.17g,%.17g,%.17g,%d;",
                            rope_scaling.factor, rope_scaling.low_freq_factor,
                            rope_scaling.high_freq_factor,
                            rope_scaling.original_max_position_embeddings);
      break;
    case RopeScalingType::kLinear:
      absl::StrAppendFormat(&text, "rope=linear,%.17g;", rope_scaling.factor);
      break;
    case RopeScalingType::kYarn:
      absl::StrAppendFormat(
          &text, "rope=yarn,%.17g,%d,%.17g,%.17g,%d,%.17g;",
          rope_scaling.factor, rope_scaling.original_max_position_embeddings,
          rope_scaling.beta_fast, rope_scaling.beta_slow,
          rope_scaling.truncate ? 1 : 0, rope_scaling.attention_factor);
      break;
    case RopeScalingType::kDynamic:
      absl::StrAppendFormat(&text, "rope=dynamic,%.17g;", rope_scaling.factor);
      break;
    case RopeScalingType::kLongrope:
      // The list the worker runs: K/V depend on it, not on the other one.
      absl::StrAppendFormat(&text, "rope=longrope,%s,%.17g",
                            rope_scaling.long_factor_active ? "long" : "short",
                            rope_scaling.attention_factor);
      for (const double f : rope_scaling.active_factors()) {
        absl::StrAppendFormat(&text, ",%.17g", f);
      }
      absl::StrAppend(&text, ";");
      break;
  }
  if (rotary_dim > 0 && rotary_dim != head_dim) {
    absl::StrAppendFormat(&text, "rotary_dim=%d;", rotary_dim);
  }
  if (local_rope_theta.has_value()) {
    absl::StrAppendFormat(&text, "local_theta=%.17g;", *local_rope_theta);
  }
  if (sliding_window.has_value()) {
    absl::StrAppendFormat(&text, "window=%d;", *sliding_window);
    // Only when some layer does not slide: every-layer windows keep the
    // string they had before per-layer windows existed.
    if (std::find(sliding_layers.begin(), sliding_layers.end(), false) !=
        sliding_layers.end()) {
      std::string layers;
      for (const bool slides : sliding_layers) layers += slides ? '1' : '0';
      absl::StrAppend(&text, "window_layers=", layers, ";");
    }
  }
  return text;
}

std::string ModelConfig::Fingerprint() const {
  return absl::StrFormat("%016x", Fnv1a64(CanonicalString()));
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text) {
  // nlohmann reports syntax errors (with their position) only by exception;
  // it is caught here so none crosses this API.
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat(kPrefix, "not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kPrefix, "must be a JSON object, got ", root.type_name()));
  }

  // A multimodal checkpoint whose text model is served alone: parse the
  // nested text config, remember where its tensors sit.
  const TextModelWrapper* wrapper = nullptr;
  if (const Json* archs = Find(root, "architectures");
      archs != nullptr && archs->is_array()) {
    for (const Json& entry : *archs) {
      if (!entry.is_string()) continue;
      wrapper = FindTextModelWrapper(entry.get<std::string>());
      if (wrapper != nullptr) break;
    }
  }
  if (wrapper != nullptr) {
    PDW_ASSIGN_OR_RETURN(root, wrapper->text_config(root));
  }

  ModelConfig config;
  if (wrapper != nullptr) {
    config.tensor_prefix = std::string(wrapper->tensor_prefix);
    for (const absl::string_view prefix : wrapper->ignored_prefixes) {
      config.ignored_tensor_prefixes.emplace_back(prefix);
    }
  }
  auto family = ParseArchitectures(root);
  if (!family.ok()) return family.status();
  config.architecture = (*family)->architecture;
  if (absl::Status status = RefuseUnsupportedFeatures(root); !status.ok()) {
    return status;
  }

  struct IntField {
    const char* name;
    int64_t* target;
  };
  const IntField required_ints[] = {
      {"hidden_size", &config.hidden_size},
      {"intermediate_size", &config.intermediate_size},
      {"num_hidden_layers", &config.num_hidden_layers},
      {"num_attention_heads", &config.num_attention_heads},
      {"vocab_size", &config.vocab_size},
      {"max_position_embeddings", &config.max_position_embeddings},
  };
  for (const IntField& field : required_ints) {
    auto value = RequiredInt(root, field.name);
    if (!value.ok()) return value.status();
    *field.target = *value;
  }

  if (const Json* kv = Find(root, "num_key_value_heads"); kv != nullptr) {
    auto value = AsInt(*kv, "num_key_value_heads");
    if (!value.ok()) return value.status();
    config.num_key_value_heads = *value;
  } else {
    config.num_key_value_heads = config.num_attention_heads;
  }

  if (const Json* head_dim = Find(root, "head_dim"); head_dim != nullptr) {
    auto value = AsInt(*head_dim, "head_dim");
    if (!value.ok()) return value.status();
    config.head_dim = *value;
  } else {
    if (config.num_attention_heads <= 0) {
      return FieldError(
          "num_attention_heads",
          absl::StrCat("must be positive, got ", config.num_attention_heads));
    }
    if (config.hidden_size % config.num_attention_heads != 0) {
      return FieldError(
          "head_dim",
          absl::StrCat("is absent and hidden_size (", config.hidden_size,
                       ") is not a multiple of num_attention_heads (",
                       config.num_attention_heads, ")"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }

  auto eps = RequiredNumber(root, "rms_norm_eps");
  if (!eps.ok()) return eps.status();
  config.rms_norm_eps = *eps;

  if (absl::Status status = ParseRope(root, &config); !status.ok()) {
    return status;
  }
  PDW_RETURN_IF_ERROR(ResolveRotaryDim(root, config));
  // YaRN without original_max_position_embeddings: transformers takes the
  // config's max_position_embeddings.
  if (config.rope_scaling.type == RopeScalingType::kYarn &&
      config.rope_scaling.original_max_position_embeddings == 0) {
    config.rope_scaling.original_max_position_embeddings =
        config.max_position_embeddings;
  }

  auto tied = OptionalBool(root, "tie_word_embeddings", false);
  if (!tied.ok()) return tied.status();
  config.tie_word_embeddings = *tied;

  // transformers >= 4.56 renamed torch_dtype to dtype.
  const char* dtype_field = "torch_dtype";
  const Json* dtype = Find(root, dtype_field);
  if (dtype == nullptr) {
    dtype_field = "dtype";
    dtype = Find(root, dtype_field);
  }
  if (dtype != nullptr) {
    if (!dtype->is_string()) {
      return FieldError(dtype_field, absl::StrCat("must be a string, got ",
                                                  Describe(*dtype)));
    }
    auto parsed = ParseTorchDType(dtype->get<std::string>());
    if (!parsed.ok()) return FieldError(dtype_field, parsed.status().message());
    config.torch_dtype = *parsed;
  }

  if (absl::Status status = (*family)->parse(root, config); !status.ok()) {
    return status;
  }
  PDW_RETURN_IF_ERROR(ResolveSlidingLayers(root, config));
  // Sliding layers with their own base rotate with plain RoPE; the global
  // layers' attention factor (yarn, longrope) is folded into the one
  // softmax scale every layer shares, which would be wrong for the others.
  if (config.local_rope_theta.has_value() &&
      config.rope_scaling.attention_factor != 1.0) {
    return FieldError(
        "rope_scaling",
        absl::StrCat(RopeScalingTypeName(config.rope_scaling.type),
                     "'s attention factor beside a local RoPE "
                     "base for the sliding layers is not "
                     "supported"));
  }
  // The family decided the MLP's activation; the config must name it.
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    const Json* act = Find(root, key);
    if (act == nullptr) continue;
    if (!act->is_string()) {
      return FieldError(key,
                        absl::StrCat("must be a string, got ", Describe(*act)));
    }
    const absl::string_view expected =
        MlpActivationName(config.layer.activation);
    if (act->get<std::string>() != expected) {
      return FieldError(key, absl::StrCat("\"", act->get<std::string>(),
                                          "\" is not supported for ",
                                          ArchitectureName(config.architecture),
                                          "; supported: ", expected));
    }
  }
  if (absl::Status status = ParseTokenIds(root, &config); !status.ok()) {
    return status;
  }
  if (absl::Status status = Validate(config); !status.ok()) return status;
  return config;
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    const std::string& json_text) {
  constexpr absl::string_view kFile = "generation_config.json: ";
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {  // syntax, or a number out of range
    return absl::InvalidArgumentError(
        absl::StrCat(kFile, "not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFile, "must be a JSON object, got ", root.type_name()));
  }
  GenerationConfig config;
  if (const Json* eos = Find(root, "eos_token_id"); eos != nullptr) {
    auto ids = ParseEosIds(*eos);
    if (!ids.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kFile, ids.status().message()));
    }
    config.eos_token_ids = *std::move(ids);
  }
  return config;
}

namespace {

// The whole file; NotFound when it cannot be opened.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad()) {
    return absl::DataLossError(absl::StrCat("error reading ", path));
  }
  return text.str();
}

}  // namespace

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = absl::StrCat(model_dir, "/config.json");
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  auto config = ParseModelConfig(*text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  const std::string generation_path =
      absl::StrCat(model_dir, "/generation_config.json");
  absl::StatusOr<std::string> generation_text = ReadFile(generation_path);
  if (absl::IsNotFound(generation_text.status())) return config;
  if (!generation_text.ok()) return generation_text.status();
  absl::StatusOr<GenerationConfig> generation =
      ParseGenerationConfig(*generation_text);
  if (!generation.ok()) {
    return absl::Status(
        generation.status().code(),
        absl::StrCat(generation_path, ": ", generation.status().message()));
  }
  if (generation->eos_token_ids.has_value()) {
    config->eos_token_ids = *generation->eos_token_ids;
    config->eos_source = ModelConfig::EosSource::kGenerationConfig;
  }
  return config;
}

}  // namespace pdworker
