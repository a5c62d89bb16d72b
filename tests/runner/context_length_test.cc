// max_model_len as ModelRunner::Create resolves it, for every device and
// the unverified-kernels switch (the device is only a kind here, so the
// CUDA rules are checked without a GPU), and LongRoPE's list chosen by it.
#include "worker/runner/context_length.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

ModelConfig Tiny(TinyShape shape) {
  TinyModelOptions options;
  options.shape = shape;
  auto config = ParseModelConfig(TinyModelConfigJson(options));
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

TEST(ContextLengthTest, DefaultsToTheConfigAndRefusesMore) {
  ModelConfig c = Tiny(TinyShape::kGqa);
  auto len = ResolveContextLength({}, &c);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, c.max_position_embeddings);
  len = ResolveContextLength({100}, &c);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, 100);
  len = ResolveContextLength({static_cast<int>(c.max_position_embeddings) + 1},
                             &c);
  ASSERT_FALSE(len.ok());
  EXPECT_EQ(len.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(len.status().message(), HasSubstr("max_position_embeddings="));
}

// mistral_window: an 8-token window on every layer.
TEST(ContextLengthTest, AWindowCapsCudaUnlessItsKernelsAreAllowed) {
  ModelConfig c = Tiny(TinyShape::kMistralWindow);
  const int full = static_cast<int>(c.max_position_embeddings);
  // The CPU attention masks to the window: the whole context.
  auto len = ResolveContextLength({0, DeviceKind::kCpu}, &c);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, full);
  // CUDA by default: the default is the window, a longer one refused.
  len = ResolveContextLength({0, DeviceKind::kCuda}, &c);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, 8);
  len = ResolveContextLength({8, DeviceKind::kCuda}, &c);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, 8);
  len = ResolveContextLength({9, DeviceKind::kCuda}, &c);
  ASSERT_FALSE(len.ok());
  EXPECT_EQ(len.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(len.status().message(), HasSubstr("window 8"));
  EXPECT_THAT(len.status().message(),
              HasSubstr("--unverified_cuda_kernels=allow"));
  // With the windowed CUDA kernels allowed: the whole context.
  len = ResolveContextLength(
      {0, DeviceKind::kCuda, UnverifiedCudaKernels::kAllow}, &c);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, full);
}

// phi4_mini: longrope over an original context of 32.
TEST(ContextLengthTest, LongropeRunsTheListItsLengthNeeds) {
  ModelConfig c = Tiny(TinyShape::kPhi4Mini);
  ASSERT_EQ(c.rope_scaling.original_max_position_embeddings, 32);
  ASSERT_TRUE(ResolveContextLength({32}, &c).ok());
  EXPECT_FALSE(c.rope_scaling.long_factor_active);
  const std::string short_fingerprint = c.Fingerprint();
  ASSERT_TRUE(ResolveContextLength({33}, &c).ok());
  EXPECT_TRUE(c.rope_scaling.long_factor_active);
  EXPECT_NE(c.Fingerprint(), short_fingerprint);
  ASSERT_TRUE(ResolveContextLength({}, &c).ok());  // 512 > 32
  EXPECT_TRUE(c.rope_scaling.long_factor_active);
  // Other scalings are left alone.
  ModelConfig plain = Tiny(TinyShape::kGqa);
  const std::string before = plain.CanonicalString();
  ASSERT_TRUE(ResolveContextLength({}, &plain).ok());
  EXPECT_EQ(plain.CanonicalString(), before);
}

}  // namespace
}  // namespace pdworker
