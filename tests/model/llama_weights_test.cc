// LoadLlamaWeights on the threaded CPU stream (uploads run after the loader
// enqueued them, as on a GPU): a load that fails after it queued uploads
// returns only once they have run, so none writes the weights arena after
// the failed load freed it.
#include "worker/model/llama_weights.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"
#include "worker/model/safetensors_writer.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/testing/stream_gate.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

// A tied tiny model whose config.json then says the LM head is untied: the
// checkpoint has every tensor but lm_head.weight, the last one loaded.
std::string UntiedWithoutLmHead() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/no_lm_head";
  TinyModelOptions options;
  options.shape = TinyShape::kTied;
  EXPECT_TRUE(WriteTinyModel(options, dir).ok());
  std::ifstream in(dir + "/config.json");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json config = nlohmann::json::parse(text.str());
  config["tie_word_embeddings"] = false;
  EXPECT_TRUE(WriteStringToFile(dir + "/config.json", config.dump()).ok());
  return dir;
}

TEST(LlamaWeightsTest, FailedLoadReturnsAfterItsQueuedUploads) {
  const std::string dir = UntiedWithoutLmHead();
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_FALSE(config->tie_word_embeddings);
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();

  CpuDeviceOptions device_options;
  device_options.stream_execution = CpuStreamExecution::kThreaded;
  CpuDevice device(device_options);
  auto stream = device.CreateStream();
  ASSERT_TRUE(stream.ok());
  // Everything the load enqueues waits behind this op until the gate opens.
  testing::Gate gate;
  std::atomic<bool> held{true};
  ASSERT_TRUE((*stream)
                  ->Launch("hold",
                           [&](const OpContext&) {
                             gate.Wait();
                             held.store(false);
                           })
                  .ok());
  testing::DelayedOpener opener(gate, std::chrono::milliseconds(200));

  absl::StatusOr<LlamaWeights> weights =
      LoadLlamaWeights(*config, **checkpoint, device, **stream);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(weights.status().message(), HasSubstr("\"lm_head.weight\""));
  EXPECT_THAT(weights.status().message(),
              HasSubstr(dir + "/model.safetensors"));
  // The embedding, every layer and the final norm were queued before the
  // missing head was noticed; the load waited for them before freeing.
  EXPECT_FALSE(held.load());
  absl::StatusOr<MemoryStats> memory = device.GetMemoryStats();
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ(memory->used_bytes, 0u);  // the arena is gone
}

}  // namespace
}  // namespace pdworker
