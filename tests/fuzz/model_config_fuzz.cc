// Fuzz target: the config.json and generation_config.json readers
// (worker/model/model_config.h) on arbitrary text. The first byte picks the
// file (even: config.json, odd: generation_config.json); the rest is its
// text. A file is refused with an error naming it, or gives a config whose
// derived sizes are meaningful (what ModelRunner then allocates from) and
// whose fingerprint is a function of the text.
#include <cstddef>
#include <cstdint>
#include <string>

#include "glog/logging.h"
#include "worker/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    auto generation = ParseGenerationConfig(text);
    if (!generation.ok()) {
      CHECK(generation.status().code() == absl::StatusCode::kInvalidArgument)
          << generation.status();
      return 0;
    }
    if (generation->eos_token_ids.has_value()) {
      for (const int64_t id : *generation->eos_token_ids) CHECK_GE(id, 0);
    }
    return 0;
  }
  auto config = ParseModelConfig(text);
  if (!config.ok()) {
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument)
        << config.status();
    CHECK(config.status().message().find("config.json") != std::string::npos)
        << config.status();
    return 0;
  }
  CHECK_GT(config->hidden_size, 0);
  CHECK_GT(config->intermediate_size, 0);
  CHECK_GT(config->num_hidden_layers, 0);
  CHECK_GT(config->num_attention_heads, 0);
  CHECK_GT(config->num_key_value_heads, 0);
  CHECK_EQ(config->num_attention_heads % config->num_key_value_heads, 0);
  CHECK_GT(config->head_dim, 0);
  CHECK_GT(config->vocab_size, 0);
  for (const int64_t id : config->eos_token_ids) CHECK_GE(id, 0);
  const std::string fingerprint = config->Fingerprint();
  CHECK_EQ(fingerprint.size(), 16u);
  auto again = ParseModelConfig(text);
  CHECK(again.ok());
  CHECK_EQ(again->Fingerprint(), fingerprint);
  return 0;
}
