#include "worker/runner/step_inputs.h"

#include <chrono>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/testing/stream_gate.h"

namespace pdworker {
namespace {

constexpr int kBlockSize = 4;

class StepInputsTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(CpuStreamExecution::kInline); }

  void Init(CpuStreamExecution execution) {
    // Owners of the previous device's memory go first.
    inputs_.reset();
    stream_.reset();
    arena_.reset();
    device_.reset();
    CpuDeviceOptions options;
    options.stream_execution = execution;
    device_ = std::make_unique<CpuDevice>(options);
    auto arena = Arena::Create(*device_, {1 << 20, 256, "test"});
    ASSERT_TRUE(arena.ok()) << arena.status();
    arena_ = std::move(*arena);
    auto stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
    limits_ = {/*max_num_seqs=*/4, /*max_num_batched_tokens=*/16,
               /*max_blocks_per_seq=*/8, /*max_uploads_in_flight=*/2,
               /*max_logits_rows=*/8};
    auto inputs = StepInputs::Create(*device_, *arena_, limits_, kBlockSize);
    ASSERT_TRUE(inputs.ok()) << inputs.status();
    inputs_ = std::move(*inputs);
  }

  std::vector<int32_t> ReadBack(DeviceBuffer b, int n) {
    std::vector<int32_t> out(n);
    EXPECT_TRUE(stream_->CopyToHost(out.data(), b, n * sizeof(int32_t)).ok());
    return out;
  }

  std::unique_ptr<CpuDevice> device_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Stream> stream_;
  StepLimits limits_;
  std::unique_ptr<StepInputs> inputs_;
  KvCacheManager kv_{/*num_blocks=*/16, kBlockSize, /*max_model_len=*/32};
};

// A mixed batch: a 5-token prefill and a decode of a sequence that already
// has 6 tokens, padded to 8 tokens (relaxed key: padding tokens belong to no
// request).
TEST_F(StepInputsTest, MixedBatchWithPaddingTokens) {
  ASSERT_TRUE(kv_.Append({{"old", 6}}).ok());
  ASSERT_TRUE(kv_.Append({{"new", 5}, {"old", 1}}).ok());
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15};
  const std::vector<int32_t> decode = {21};
  const SequenceKv* a = kv_.Find("new");
  const SequenceKv* b = kv_.Find("old");
  ASSERT_TRUE(inputs_->Build({{a, prompt}, {b, decode}}, {8, 2, 0}).ok());
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());

  // Expected values computed here from the block tables, not by the code.
  std::vector<int32_t> slots;
  for (int p = 0; p < 5; ++p) {
    slots.push_back(a->blocks[p / kBlockSize] * kBlockSize + p % kBlockSize);
  }
  slots.push_back(b->blocks[6 / kBlockSize] * kBlockSize + 6 % kBlockSize);
  for (int p = 0; p < 2; ++p) slots.push_back(-1);

  const StepBuffers& buf = inputs_->buffers();
  EXPECT_EQ(ReadBack(buf.token_ids, 8),
            (std::vector<int32_t>{11, 12, 13, 14, 15, 21, 0, 0}));
  EXPECT_EQ(ReadBack(buf.positions, 8),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 6, 0, 0}));
  EXPECT_EQ(ReadBack(buf.slot_mapping, 8), slots);
  EXPECT_EQ(ReadBack(buf.seq_lens, 2), (std::vector<int32_t>{5, 7}));
  EXPECT_EQ(ReadBack(buf.query_start_loc, 3), (std::vector<int32_t>{0, 5, 6}));
  EXPECT_EQ(ReadBack(buf.num_reqs, 1), (std::vector<int32_t>{2}));
  EXPECT_EQ(ReadBack(buf.logits_indices, 2), (std::vector<int32_t>{4, 5}));
  std::vector<int32_t> tables = ReadBack(buf.block_tables, 2 * 8);
  EXPECT_EQ(tables[0], a->blocks[0]);
  EXPECT_EQ(tables[1], a->blocks[1]);
  EXPECT_EQ(tables[8], b->blocks[0]);
  EXPECT_EQ(tables[9], b->blocks[1]);
  // Only the blocks a sequence holds cross the bus; the unpack writes the
  // rest of each row as zeros over the poisoned buffer.
  for (int j = 2; j < 8; ++j) EXPECT_EQ(tables[j], 0) << j;
  for (int j = 10; j < 16; ++j) EXPECT_EQ(tables[j], 0) << j;
  // Rows past the requests: a zero logits row, never an uninitialized index.
  EXPECT_EQ(ReadBack(buf.logits_indices, 4),
            (std::vector<int32_t>{4, 5, -1, -1}));
}

// Uniform decode of 3 sequences padded to a 4-request key: the padding
// request has an empty context and its own padding token.
TEST_F(StepInputsTest, UniformDecodeWithPaddingRequest) {
  ASSERT_TRUE(kv_.Append({{"x", 3}, {"y", 4}, {"z", 1}}).ok());
  ASSERT_TRUE(kv_.Append({{"x", 1}, {"y", 1}, {"z", 1}}).ok());
  const std::vector<int32_t> t1 = {1}, t2 = {2}, t3 = {3};
  ASSERT_TRUE(
      inputs_
          ->Build(
              {{kv_.Find("x"), t1}, {kv_.Find("y"), t2}, {kv_.Find("z"), t3}},
              {4, 4, 1})
          .ok());
  EXPECT_EQ(std::vector<int32_t>(inputs_->host_seq_lens().begin(),
                                 inputs_->host_seq_lens().end()),
            (std::vector<int32_t>{4, 5, 2, 0}));
  EXPECT_EQ(std::vector<int32_t>(inputs_->host_query_start_loc().begin(),
                                 inputs_->host_query_start_loc().end()),
            (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(inputs_->host_slot_mapping()[3], -1);
  EXPECT_EQ(inputs_->host_positions()[1], 4);
  EXPECT_EQ(std::vector<int32_t>(inputs_->host_logits_indices().begin(),
                                 inputs_->host_logits_indices().end()),
            (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(inputs_->num_reqs(), 3);
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());
  // The padding request's row and every row past it: zero logits.
  EXPECT_EQ(ReadBack(inputs_->buffers().logits_indices, 8),
            (std::vector<int32_t>{0, 1, 2, -1, -1, -1, -1, -1}));
}

// Verifying drafts: two sequences of 1 + 2 tokens each with a logits row
// after every token, padded to a 3-request uniform key of query length 3,
// then a mixed step where one sequence asks for rows after its last two of
// four tokens.
TEST_F(StepInputsTest, RequestsWithSeveralLogitsRows) {
  ASSERT_TRUE(kv_.Append({{"a", 5}, {"b", 2}}).ok());
  ASSERT_TRUE(kv_.Append({{"a", 3}, {"b", 3}}).ok());
  const std::vector<int32_t> ta = {1, 2, 3}, tb = {4, 5, 6};
  StepSequence a{kv_.Find("a"), ta, 3}, b{kv_.Find("b"), tb, 3};
  ASSERT_TRUE(inputs_->Build({a, b}, {9, 3, 3}).ok());
  EXPECT_EQ(inputs_->num_logits(), 6);
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());
  const StepBuffers& buf = inputs_->buffers();
  EXPECT_EQ(ReadBack(buf.logits_indices, 8),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 5, -1, -1}));
  EXPECT_EQ(ReadBack(buf.positions, 6),
            (std::vector<int32_t>{5, 6, 7, 2, 3, 4}));
  EXPECT_EQ(ReadBack(buf.query_start_loc, 4),
            (std::vector<int32_t>{0, 3, 6, 9}));

  ASSERT_TRUE(kv_.Append({{"c", 4}, {"a", 1}}).ok());
  const std::vector<int32_t> tc = {7, 8, 9, 10}, one = {11};
  StepSequence c{kv_.Find("c"), tc, 2}, a1{kv_.Find("a"), one, 1};
  ASSERT_TRUE(inputs_->Build({c, a1}, {6, 2, 0}).ok());
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());
  EXPECT_EQ(ReadBack(buf.logits_indices, 8),
            (std::vector<int32_t>{2, 3, 4, -1, -1, -1, -1, -1}));
}

TEST_F(StepInputsTest, LogitsRowsOutsideTheirLimitsAreRefused) {
  ASSERT_TRUE(kv_.Append({{"a", 3}, {"b", 3}, {"c", 3}}).ok());
  const std::vector<int32_t> three = {1, 2, 3};
  StepSequence a{kv_.Find("a"), three, 4};
  EXPECT_EQ(inputs_->Build({a}, {3, 1, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  a.num_logits = 0;
  EXPECT_EQ(inputs_->Build({a}, {3, 1, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  // 9 rows; the limit is 8.
  a.num_logits = 3;
  const StepSequence b{kv_.Find("b"), three, 3}, c{kv_.Find("c"), three, 3};
  const absl::Status status = inputs_->Build({a, b, c}, {9, 3, 0});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("max_logits_rows"), std::string::npos)
      << status;
}

// A step after a wider one: nothing of the earlier block tables or logits
// rows survives in the rows this step uses.
TEST_F(StepInputsTest, AnEarlierWiderStepLeavesNothingBehind) {
  ASSERT_TRUE(kv_.Append({{"long", 10}, {"other", 5}}).ok());
  const std::vector<int32_t> ten(10, 7), five(5, 8), one = {9};
  ASSERT_TRUE(inputs_
                  ->Build({{kv_.Find("long"), ten}, {kv_.Find("other"), five}},
                          {16, 2, 0})
                  .ok());
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());
  ASSERT_TRUE(kv_.Append({{"short", 1}}).ok());
  const SequenceKv* s = kv_.Find("short");
  ASSERT_EQ(s->blocks.size(), 1u);
  ASSERT_TRUE(inputs_->Build({{s, one}}, {1, 1, 0}).ok());
  ASSERT_TRUE(inputs_->Upload(*stream_).ok());

  const StepBuffers& buf = inputs_->buffers();
  std::vector<int32_t> row(8, 0);
  row[0] = s->blocks[0];
  EXPECT_EQ(ReadBack(buf.block_tables, 8), row);
  EXPECT_EQ(ReadBack(buf.logits_indices, 4),
            (std::vector<int32_t>{0, -1, -1, -1}));
  EXPECT_EQ(ReadBack(buf.num_reqs, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(ReadBack(buf.seq_lens, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(ReadBack(buf.token_ids, 1), (std::vector<int32_t>{9}));
  const absl::Span<const int32_t> host_row = inputs_->host_block_table_row(0);
  EXPECT_EQ(std::vector<int32_t>(host_row.begin(), host_row.end()),
            std::vector<int32_t>{s->blocks[0]});
}

TEST_F(StepInputsTest, UploadBeforeAnyBuildIsRefused) {
  EXPECT_EQ(inputs_->Upload(*stream_).code(),
            absl::StatusCode::kFailedPrecondition);
}

// With the device behind the host (threaded stream held at a gate), three
// uploads cycle through two pinned staging blocks: the third Build must wait
// for the first upload's copy before it rewrites that block, or the first
// step would read the third step's tokens.
TEST_F(StepInputsTest, AStagingBlockIsReusedOnlyAfterItsCopyRan) {
  Init(CpuStreamExecution::kThreaded);
  ASSERT_TRUE(kv_.Append({{"a", 2}, {"b", 2}, {"c", 2}}).ok());
  testing::Gate gate;
  ASSERT_TRUE(
      stream_
          ->Launch("wait_for_gate", [&gate](const OpContext&) { gate.Wait(); })
          .ok());
  const std::vector<std::vector<int32_t>> tokens = {
      {11, 12}, {21, 22}, {31, 32}};
  const char* ids[] = {"a", "b", "c"};
  std::vector<std::vector<int32_t>> seen(3, std::vector<int32_t>(2, -1));
  std::unique_ptr<testing::DelayedOpener> opener;
  for (int step = 0; step < 3; ++step) {
    // Opened long after the third Build starts: one that did not wait would
    // have overwritten the first step's block by then.
    if (step == 2) {
      opener = std::make_unique<testing::DelayedOpener>(
          gate, std::chrono::milliseconds(200));
    }
    ASSERT_TRUE(
        inputs_->Build({{kv_.Find(ids[step]), tokens[step]}}, {2, 1, 0}).ok());
    ASSERT_TRUE(inputs_->Upload(*stream_).ok());
    ASSERT_TRUE(stream_
                    ->CopyToHostAsync(seen[step].data(),
                                      inputs_->buffers().token_ids,
                                      2 * sizeof(int32_t))
                    .ok());
  }
  opener.reset();
  ASSERT_TRUE(stream_->Synchronize().ok());
  EXPECT_EQ(seen, tokens);
}

TEST_F(StepInputsTest, RejectsShapesThatDoNotFit) {
  ASSERT_TRUE(kv_.Append({{"x", 3}}).ok());
  const std::vector<int32_t> t = {1, 2, 3};
  const SequenceKv* x = kv_.Find("x");
  // Fewer padded tokens than real ones.
  EXPECT_FALSE(inputs_->Build({{x, t}}, {2, 1, 0}).ok());
  // Beyond the token limit.
  EXPECT_FALSE(inputs_->Build({{x, t}}, {17, 1, 0}).ok());
  // Padding requests that do not cover the padding tokens exactly.
  EXPECT_FALSE(inputs_->Build({{x, t}}, {4, 2, 2}).ok());
  // Empty batch.
  EXPECT_FALSE(inputs_->Build({}, {4, 1, 0}).ok());
}

}  // namespace
}  // namespace pdworker
