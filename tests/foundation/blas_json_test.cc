// Proves OpenBLAS and nlohmann-json link and behave (foundation issue).
#include <cblas.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace {

TEST(OpenBlasTest, SgemmMatchesHandComputedProduct) {
  // [2x3] * [3x2]^T-free product, row-major: C = A * B.
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};     // 2x3
  const std::vector<float> b = {7, 8, 9, 10, 11, 12};  // 3x2
  std::vector<float> c(4, -1.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 3, 1.0f,
              a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{58, 64, 139, 154}));
}

TEST(NlohmannJsonTest, ParsesAndRejects) {
  auto j = nlohmann::json::parse(R"({"cudagraph_mode":"FULL","sizes":[1,2]})");
  EXPECT_EQ(j["cudagraph_mode"].get<std::string>(), "FULL");
  EXPECT_EQ(j["sizes"].size(), 2u);
  EXPECT_THROW(
      {
        const nlohmann::json bad = nlohmann::json::parse("{bad");
        (void)bad;
      },
      nlohmann::json::parse_error);
  EXPECT_TRUE(nlohmann::json::parse("{bad", nullptr, /*allow_exceptions=*/false)
                  .is_discarded());
}

}  // namespace
