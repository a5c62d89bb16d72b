// A model family: how one `architectures` entry of config.json maps onto a
// ModelConfig. The keys every family shares (sizes, heads, head_dim, RMSNorm
// eps, RoPE, vocabulary, tying, dtype, token ids) are read by
// ParseModelConfig; the family reads its own (attention biases, q/k norm,
// sliding window) into config->layer and config->sliding_window, and refuses
// the values pdworker does not run, naming the key.
//
// Adding a family: a file in worker/model/families/ defining its ModelFamily,
// its entry in ModelFamilies() (families/model_families.cc), the Architecture
// value, and its tests (a tiny checkpoint in tools/make_tiny_model and its
// float64 reference in tests/reference/).
#ifndef PDWORKER_WORKER_MODEL_MODEL_FAMILY_H_
#define PDWORKER_WORKER_MODEL_MODEL_FAMILY_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/model/config_json.h"
#include "worker/model/model_config.h"

namespace pdworker {

struct ModelFamily {
  Architecture architecture;
  absl::string_view architecture_name;  // "Qwen3ForCausalLM"
  absl::string_view model_type;         // config.json "model_type": "qwen3"
  // Reads the family's own keys from config.json's `root` into `config`
  // (whose shared fields are already parsed).
  absl::Status (*parse)(const config_json::Json& root, ModelConfig& config);
};

// A multimodal checkpoint whose text model pdworker serves alone: its
// config.json nests the text model's under "text_config" (keys absent there
// take the text config class's defaults), its text tensors sit under
// `tensor_prefix`, and the other towers' tensors (`ignored_prefixes`) are
// left unread.
struct TextModelWrapper {
  absl::string_view architecture_name;  // "Gemma3ForConditionalGeneration"
  absl::string_view tensor_prefix;      // "language_model."
  absl::Span<const absl::string_view> ignored_prefixes;
  // The text model's config.json, naming its family in "architectures".
  absl::StatusOr<config_json::Json> (*text_config)(
      const config_json::Json& root);
};
extern const TextModelWrapper kGemma3MultimodalWrapper;

// The wrapper named `architecture_name`, or nullptr.
const TextModelWrapper* FindTextModelWrapper(
    absl::string_view architecture_name);

// One per file in worker/model/families/.
extern const ModelFamily kLlamaFamily;
extern const ModelFamily kQwen2Family;
extern const ModelFamily kMistralFamily;
extern const ModelFamily kQwen3Family;
extern const ModelFamily kPhi3Family;
extern const ModelFamily kGemma2Family;
extern const ModelFamily kGemma3Family;

// Every family pdworker serves, in the order errors list them.
absl::Span<const ModelFamily* const> ModelFamilies();

// The family of `architecture_name`, or nullptr.
const ModelFamily* FindModelFamily(absl::string_view architecture_name);
const ModelFamily& FamilyOf(Architecture architecture);

// Qwen2's and Qwen3's "use_sliding_window" (default false) with
// "sliding_window" (then required, positive) into config.sliding_window,
// applying to the layers from "max_window_layers" (default 28) on.
absl::Status ParseQwenSlidingWindow(const config_json::Json& root,
                                    ModelConfig& config);

// Gemma 2's and Gemma 3's layer (families/gemma2.cc): sandwich (1 + w)
// norms, GeGLU, the sqrt(hidden) embedding multiplier, no attention_bias,
// query_pre_attn_scalar, the caps and sliding_window, with the configs'
// defaults where a key is absent (head_dim 256, query_pre_attn_scalar 256,
// window 4096, tied embeddings; the caps below; null: none). The sliding
// layers are the caller's.
struct GemmaDefaults {
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
};
absl::Status ParseGemmaLayer(const config_json::Json& root,
                             const GemmaDefaults& defaults,
                             ModelConfig& config);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_MODEL_FAMILY_H_
