#include "dispatcher/compilation_config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CompilationConfigTest, ParsesAllFields) {
  auto config = ParseCompilationConfig(
      R"({"cudagraph_mode":"FULL_AND_PIECEWISE",
          "cudagraph_capture_sizes":[1,2,4,8],
          "max_cudagraph_capture_size":8})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->cudagraph_mode, CudaGraphMode::FullAndPiecewise());
  ASSERT_TRUE(config->cudagraph_capture_sizes.has_value());
  EXPECT_THAT(*config->cudagraph_capture_sizes, ElementsAre(1, 2, 4, 8));
  EXPECT_EQ(config->max_cudagraph_capture_size, 8);
}

TEST(CompilationConfigTest, EmptyTextAndEmptyObjectAndNullsKeepDefaults) {
  for (const char* text : {"", "  \n", "{}",
                           R"({"cudagraph_mode":null,
                               "cudagraph_capture_sizes":null,
                               "max_cudagraph_capture_size":null})"}) {
    auto config = ParseCompilationConfig(text);
    ASSERT_TRUE(config.ok()) << text << ": " << config.status();
    EXPECT_FALSE(config->cudagraph_mode.has_value());
    EXPECT_FALSE(config->cudagraph_capture_sizes.has_value());
    EXPECT_FALSE(config->max_cudagraph_capture_size.has_value());
  }
}

TEST(CompilationConfigTest, ModeIsCaseInsensitive) {
  auto config =
      ParseCompilationConfig(R"({"cudagraph_mode":"full_decode_only"})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->cudagraph_mode, CudaGraphMode::FullDecodeOnly());
}

TEST(CompilationConfigTest, ErrorsNameTheField) {
  struct Case {
    const char* json;
    std::vector<const char*> needles;
  };
  const Case cases[] = {
      {R"({"cudagraph_mode": )", {"compilation_config is not valid JSON"}},
      // A number a double cannot hold (found by compilation_config_fuzz:
      // the parser's out_of_range exception was not caught).
      {R"({"max_cudagraph_capture_size": 1e999})",
       {"compilation_config is not valid JSON", "number overflow"}},
      {R"([1, 2])", {"must be a JSON object", "array"}},
      {R"({"cudagraph_mode": 3})",
       {"compilation_config.cudagraph_mode must be a string", "number"}},
      {R"({"cudagraph_mode": "FAST"})",
       {"compilation_config.cudagraph_mode", "FAST", "FULL_DECODE_ONLY"}},
      {R"({"cudagraph_capture_sizes": 8})",
       {"compilation_config.cudagraph_capture_sizes must be an array"}},
      {R"({"cudagraph_capture_sizes": [1, "2"]})",
       {"compilation_config.cudagraph_capture_sizes[1] must be an integer",
        "string"}},
      {R"({"cudagraph_capture_sizes": [1, 2.5]})",
       {"compilation_config.cudagraph_capture_sizes[1] must be an integer"}},
      {R"({"cudagraph_capture_sizes": [1, 99999999999]})",
       {"compilation_config.cudagraph_capture_sizes[1] = 99999999999 is out "
        "of range"}},
      {R"({"max_cudagraph_capture_size": "512"})",
       {"compilation_config.max_cudagraph_capture_size must be an integer"}},
      {R"({"max_cudagraph_capture_size": -99999999999})",
       {"compilation_config.max_cudagraph_capture_size", "out of range"}},
      {R"({"cudagraph_capture_size": [1]})",
       {"unknown field 'cudagraph_capture_size'", "cudagraph_capture_sizes",
        "max_cudagraph_capture_size"}},
  };
  for (const Case& c : cases) {
    auto config = ParseCompilationConfig(c.json);
    ASSERT_FALSE(config.ok()) << c.json;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    for (const char* needle : c.needles) {
      EXPECT_THAT(config.status().message(), HasSubstr(needle)) << c.json;
    }
  }
}

TEST(CompilationConfigTest, ToJsonRoundTrips) {
  CompilationConfig config;
  EXPECT_EQ(config.ToJson(), "{}");
  config.cudagraph_mode = CudaGraphMode::Piecewise();
  config.cudagraph_capture_sizes = std::vector<int>{4, 8};
  config.max_cudagraph_capture_size = 8;
  auto parsed = ParseCompilationConfig(config.ToJson());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->cudagraph_mode, config.cudagraph_mode);
  EXPECT_EQ(parsed->cudagraph_capture_sizes, config.cudagraph_capture_sizes);
  EXPECT_EQ(parsed->max_cudagraph_capture_size,
            config.max_cudagraph_capture_size);
}

}  // namespace
}  // namespace pdworker
