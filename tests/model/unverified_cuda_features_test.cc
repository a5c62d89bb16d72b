// Which tiny shapes need CUDA kernels written without a GPU
// (UnverifiedCudaFeatures): what LlamaForward::Create refuses on CUDA by
// default, names in its message, and keeps off the fused decode paths. The
// GPU tests' expectations derive from it, so it is checked here, without a
// GPU, against each family's layer.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/llama_forward.h"
#include "worker/model/model_config.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<std::string> FeaturesOf(TinyShape shape) {
  TinyModelOptions options;
  options.shape = shape;
  auto config = ParseModelConfig(TinyModelConfigJson(options));
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? UnverifiedCudaFeatures(*config)
                     : std::vector<std::string>{};
}

TEST(UnverifiedCudaFeaturesTest, NameWhatEachFamilyNeeds) {
  for (const TinyShape shape :
       {TinyShape::kGqa, TinyShape::kTied, TinyShape::kQkvBias,
        TinyShape::kHeadDim, TinyShape::kLlama3Rope, TinyShape::kLinearRope,
        TinyShape::kYarnRope, TinyShape::kPhi3, TinyShape::kMistralWindow}) {
    EXPECT_THAT(FeaturesOf(shape), IsEmpty()) << TinyShapeName(shape);
  }
  EXPECT_THAT(FeaturesOf(TinyShape::kQwen3),
              ElementsAre(HasSubstr("per-head q/k norm")));
  EXPECT_THAT(FeaturesOf(TinyShape::kPhi4Mini),
              ElementsAre(HasSubstr("partial rotary")));
  EXPECT_THAT(
      FeaturesOf(TinyShape::kGemma2),
      ElementsAre(HasSubstr("sandwich norms"), HasSubstr("gelu_pytorch_tanh"),
                  "attn_logit_softcapping", "final_logit_softcapping",
                  HasSubstr("embedding multiplier")));
  EXPECT_THAT(
      FeaturesOf(TinyShape::kGemma3),
      ElementsAre(HasSubstr("per-head q/k norm"), HasSubstr("sandwich norms"),
                  HasSubstr("gelu_pytorch_tanh"),
                  HasSubstr("embedding multiplier")));
  EXPECT_EQ(FeaturesOf(TinyShape::kGemma3Multimodal),
            FeaturesOf(TinyShape::kGemma3));
}

}  // namespace
}  // namespace pdworker
