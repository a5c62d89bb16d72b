// The model runner's memory and the work queued on its stream (threaded CPU
// stream, held by a gate so the work is surely still queued): blocks handed
// to another stream, and the runner's own buffers at destruction, are
// released only after that work has run.
#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"
#include "worker/runtime/testing/stream_gate.h"

namespace pdworker {
namespace {

using runner_testing::SmallOptions;
using runner_testing::TinyModelDir;

std::unique_ptr<ModelRunner> ThreadedRunner(Device& device) {
  auto dir = TinyModelDir(TinyShape::kGqa);
  EXPECT_TRUE(dir.ok()) << dir.status();
  auto runner = ModelRunner::Create(
      device, *dir, SmallOptions(R"({"cudagraph_mode":"NONE"})"));
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

CpuDeviceOptions ThreadedStreams() {
  CpuDeviceOptions options;
  options.stream_execution = CpuStreamExecution::kThreaded;
  return options;
}

// Blocks freed while the runner's stream still writes them (a failed
// step's Undo, an abort, a flushed prefix) are reused in order on that
// stream, but a KV pull fills detached blocks on a stream of its own: the
// allocation waits until the runner's queued work has run.
TEST(ModelRunnerStreamTest, DetachedBlocksWaitForQueuedWork) {
  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  testing::Gate gate;
  std::atomic<bool> held{true};
  ASSERT_TRUE(runner->stream()
                  .Launch("hold",
                          [&](const OpContext&) {
                            gate.Wait();
                            held.store(false);
                          })
                  .ok());
  testing::DelayedOpener opener(gate, std::chrono::milliseconds(200));
  absl::StatusOr<SequenceKv> kv = runner->AllocateDetached(8);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_FALSE(held.load());
  runner->FreeDetached(*kv);
}

// An abort while the sequence's step is still queued (the engine releases
// a cancelled request's KV at once): the freed blocks go to the next
// sequence, whose step is queued behind the aborted one on the same
// in-order stream, so the aborted step's K/V writes land first and are
// overwritten; the new sequence computes exactly what it computes alone.
TEST(ModelRunnerStreamTest, AbortWhileItsStepIsQueuedLeavesReusedBlocksIntact) {
  const std::vector<int32_t> aborted_prompt = {5, 9, 2, 7, 1, 3, 8, 6, 4, 2};
  const std::vector<int32_t> prompt = {11, 3, 17, 2, 9, 30, 4, 21, 8, 1};
  // Alone: the prefill's token and two decode steps after it.
  std::vector<int32_t> expected;
  {
    CpuDevice device(ThreadedStreams());
    std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
    ASSERT_NE(runner, nullptr);
    auto first = runner->Execute(
        {MakeSequenceStep("b", prompt, SequenceCreation::kMustBeNew)});
    ASSERT_TRUE(first.ok()) << first.status();
    expected.push_back(first->sequences[0].token_id);
    for (int i = 0; i < 2; ++i) {
      auto next = runner->Execute({MakeSequenceStep(
          "b", {expected.back()}, SequenceCreation::kMustExist)});
      ASSERT_TRUE(next.ok()) << next.status();
      expected.push_back(next->sequences[0].token_id);
    }
  }

  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  testing::Gate gate;
  ASSERT_TRUE(runner->stream()
                  .Launch("hold", [&](const OpContext&) { gate.Wait(); })
                  .ok());
  auto aborted = runner->Launch(
      {MakeSequenceStep("a", aborted_prompt, SequenceCreation::kMustBeNew)});
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  const std::vector<int32_t> aborted_blocks =
      runner->kv_cache().Find("a")->blocks;
  ASSERT_TRUE(runner->Release("a").ok());
  auto reused = runner->Launch(
      {MakeSequenceStep("b", prompt, SequenceCreation::kMustBeNew)});
  ASSERT_TRUE(reused.ok()) << reused.status();
  // The cache hands the aborted sequence's blocks to the new one.
  EXPECT_EQ(runner->kv_cache().Find("b")->blocks, aborted_blocks);
  gate.Open();
  ASSERT_TRUE(runner->Retire(*aborted).ok());
  auto first = runner->Retire(*reused);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<int32_t> got = {first->sequences[0].token_id};
  for (int i = 0; i < 2; ++i) {
    auto next = runner->Execute(
        {MakeSequenceStep("b", {got.back()}, SequenceCreation::kMustExist)});
    ASSERT_TRUE(next.ok()) << next.status();
    got.push_back(next->sequences[0].token_id);
  }
  EXPECT_EQ(got, expected);
}

// A runner destroyed with work queued (a step launched and never retired,
// a Create that failed half way) frees its weights, arenas and KV cache
// only after that work ran: the work still sees all of them allocated.
TEST(ModelRunnerStreamTest, DestructionWaitsForQueuedWork) {
  CpuDevice device(ThreadedStreams());
  std::unique_ptr<ModelRunner> runner = ThreadedRunner(device);
  ASSERT_NE(runner, nullptr);
  const size_t allocated = device.GetMemoryStats()->used_bytes;
  ASSERT_GT(allocated, 0u);
  testing::Gate gate;
  std::atomic<size_t> allocated_when_run{0};
  ASSERT_TRUE(runner->stream()
                  .Launch("hold",
                          [&](const OpContext&) {
                            gate.Wait();
                            allocated_when_run.store(
                                device.GetMemoryStats()->used_bytes);
                          })
                  .ok());
  {
    testing::DelayedOpener opener(gate, std::chrono::milliseconds(200));
    runner.reset();
  }
  EXPECT_EQ(allocated_when_run.load(), allocated);
  EXPECT_EQ(device.GetMemoryStats()->used_bytes, 0u);
}

}  // namespace
}  // namespace pdworker
