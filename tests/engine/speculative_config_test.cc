// --speculative_config: vLLM's JSON form, its ngram defaults, and refusals
// that name the key or the method.
#include "worker/engine/speculative_config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

TEST(SpeculativeConfigTest, EmptyIsOff) {
  absl::StatusOr<SpeculativeConfig> c = ParseSpeculativeConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->enabled());
}

TEST(SpeculativeConfigTest, NgramWithVllmsDefaults) {
  struct Case {
    std::string json;
    int k, min, max, disable_by_batch_size;
  };
  for (const Case& c : {
           Case{R"({"method": "ngram", "num_speculative_tokens": 3,
                    "prompt_lookup_min": 2, "prompt_lookup_max": 4})",
                3, 2, 4, 0},
           // Neither bound: 5 and 5; one: the other takes its value.
           Case{R"({"method": "ngram", "num_speculative_tokens": 5})", 5, 5, 5,
                0},
           Case{R"({"method": "ngram", "num_speculative_tokens": 2,
                    "prompt_lookup_max": 4})",
                2, 4, 4, 0},
           Case{R"({"method": "ngram", "num_speculative_tokens": 2,
                    "prompt_lookup_min": 3})",
                2, 3, 3, 0},
           // vLLM's older spelling: the model names the method.
           Case{R"({"model": "[ngram]", "num_speculative_tokens": 4,
                    "disable_by_batch_size": 32})",
                4, 5, 5, 32},
       }) {
    SCOPED_TRACE(c.json);
    absl::StatusOr<SpeculativeConfig> parsed = ParseSpeculativeConfig(c.json);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->method, SpeculativeMethod::kNgram);
    EXPECT_EQ(parsed->num_speculative_tokens, c.k);
    EXPECT_EQ(parsed->prompt_lookup_min, c.min);
    EXPECT_EQ(parsed->prompt_lookup_max, c.max);
    EXPECT_EQ(parsed->disable_by_batch_size, c.disable_by_batch_size);
  }
}

TEST(SpeculativeConfigTest, RefusalsNameTheKeyOrMethod) {
  struct Case {
    std::string json;
    absl::StatusCode code;
    std::string message;
  };
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const absl::StatusCode kUnimplemented = absl::StatusCode::kUnimplemented;
  for (const Case& c : {
           Case{"{", kInvalid, "not a JSON object"},
           Case{"[1]", kInvalid, "not a JSON object"},
           Case{R"({"method": "ngram"})", kInvalid,
                "num_speculative_tokens is required"},
           Case{R"({"method": "ngram", "num_speculative_tokens": 0})", kInvalid,
                "num_speculative_tokens must be a positive"},
           Case{R"({"method": "ngram", "num_speculative_tokens": "3"})",
                kInvalid, "num_speculative_tokens must be a positive"},
           Case{R"({"method": "ngram", "num_speculative_tokens": 3,
                    "prompt_lookup_min": 4, "prompt_lookup_max": 2})",
                kInvalid, "prompt_lookup_min (4) exceeds prompt_lookup_max"},
           Case{R"({"method": "ngram", "num_speculative_tokens": 3,
                    "draft_tensor_parallel_size": 1})",
                kInvalid, "unsupported key \"draft_tensor_parallel_size\""},
           Case{R"({"num_speculative_tokens": 3})", kInvalid,
                "method is missing"},
           Case{R"({"method": 3, "num_speculative_tokens": 3})", kInvalid,
                "method must be a string"},
           Case{R"({"method": "ngram", "model": "meta-llama/x",
                    "num_speculative_tokens": 3})",
                kInvalid, "model \"meta-llama/x\" with method \"ngram\""},
           Case{R"({"method": "eagle3", "model": "yuhuili/EAGLE3",
                    "num_speculative_tokens": 3})",
                kUnimplemented, "method \"eagle3\" is not supported yet"},
           Case{R"({"method": "draft_model", "model": "/m",
                    "num_speculative_tokens": 3})",
                kUnimplemented, "method \"draft_model\""},
           Case{
               R"({"model": "/models/llama-68m", "num_speculative_tokens": 3})",
               kUnimplemented, "a draft model (model \"/models/llama-68m\")"},
       }) {
    SCOPED_TRACE(c.json);
    absl::StatusOr<SpeculativeConfig> parsed = ParseSpeculativeConfig(c.json);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), c.code) << parsed.status();
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.message));
    EXPECT_THAT(parsed.status().message(), HasSubstr("speculative_config"));
  }
}

}  // namespace
}  // namespace pdworker
