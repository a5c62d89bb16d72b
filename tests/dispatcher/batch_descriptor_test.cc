#include "dispatcher/batch_descriptor.h"

#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

TEST(BatchDescriptorTest, RelaxedDropsRequestsAndUniformity) {
  const BatchDescriptor uniform{8, 8, true};
  EXPECT_EQ(uniform.relaxed(), (BatchDescriptor{8, 0, false}));
  EXPECT_EQ(uniform.relaxed().relaxed(), uniform.relaxed());
  EXPECT_NE(uniform, uniform.relaxed());
}

TEST(BatchDescriptorTest, HashDistinguishesEveryField) {
  absl::flat_hash_set<BatchDescriptor> set = {
      {8, 8, true}, {8, 0, false}, {8, 4, true}, {16, 0, false}};
  EXPECT_EQ(set.size(), 4u);
  EXPECT_TRUE(set.contains(BatchDescriptor{8, 4, true}));
  EXPECT_FALSE(set.contains(BatchDescriptor{8, 4, false}));
}

TEST(BatchDescriptorTest, PrintsAllFields) {
  std::ostringstream os;
  os << BatchDescriptor{12, 6, true};
  EXPECT_EQ(os.str(),
            "BatchDescriptor(num_tokens=12, num_reqs=6, uniform=true)");
  EXPECT_EQ(BatchDescriptor{}.ToString(),
            "BatchDescriptor(num_tokens=0, num_reqs=0, uniform=false)");
}

TEST(BatchDescriptorTest, OrdersByTokensFirst) {
  EXPECT_LT((BatchDescriptor{4, 4, true}), (BatchDescriptor{8, 0, false}));
  EXPECT_LT((BatchDescriptor{8, 0, false}), (BatchDescriptor{8, 8, true}));
}

TEST(ClassifyBatchTest, UniformOnlyWhenEveryQueryHasTheDecodeLength) {
  // 4 single-token decodes.
  EXPECT_EQ(ClassifyBatch(4, 4, 1, 1), BatchKind::kUniformDecode);
  // A prefill among decodes: longest query is 5.
  EXPECT_EQ(ClassifyBatch(8, 4, 5, 1), BatchKind::kMixed);
  // Spec decode with 2 draft tokens: 3 requests x 3 tokens.
  EXPECT_EQ(ClassifyBatch(9, 3, 3, 3), BatchKind::kUniformDecode);
  // Ragged spec decode: longest is 3 but one request verifies fewer tokens.
  EXPECT_EQ(ClassifyBatch(8, 3, 3, 3), BatchKind::kMixed);
  // Plain decode while the worker expects spec-decode query length.
  EXPECT_EQ(ClassifyBatch(3, 3, 1, 3), BatchKind::kOneTokenDecode);
  // One-token batches are their own kind only when speculation makes the
  // uniform query length longer; a prefill is mixed.
  EXPECT_EQ(ClassifyBatch(3, 3, 1, 1), BatchKind::kUniformDecode);
  EXPECT_EQ(ClassifyBatch(4, 3, 2, 3), BatchKind::kMixed);
  EXPECT_EQ(UniformQueryLen(BatchDescriptor{12, 3, true}), 4);
  EXPECT_EQ(UniformQueryLen(BatchDescriptor{12, 0, false}), 0);
  // Empty batch.
  EXPECT_EQ(ClassifyBatch(0, 0, 0, 1), BatchKind::kMixed);
}

}  // namespace
}  // namespace pdworker
