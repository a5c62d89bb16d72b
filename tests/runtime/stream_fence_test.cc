// StreamFence: memory released after a fence is released only after the
// work queued on the fence's stream has run (threaded CPU stream, held by a
// gate so the work is surely still queued when the owner lets go).
#include "worker/runtime/stream_fence.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/testing/stream_gate.h"

namespace pdworker {
namespace {

using testing::DelayedOpener;
using testing::Gate;
using ::testing::HasSubstr;

CpuDeviceOptions ThreadedStreams() {
  CpuDeviceOptions options;
  options.stream_execution = CpuStreamExecution::kThreaded;
  return options;
}

class StreamFenceTest : public ::testing::Test {
 protected:
  StreamFenceTest() : device_(ThreadedStreams()) {
    auto stream = device_.CreateStream();
    CHECK(stream.ok());
    stream_ = *std::move(stream);
  }

  // Queues an op that waits for `gate`, then writes `value` into `*out`
  // (memory the test frees right after its fence).
  void QueueWrite(Gate& gate, std::vector<int>* out, int value) {
    ASSERT_TRUE(stream_
                    ->Launch("gated_write",
                             [this, &gate, out, value](const OpContext&) {
                               gate.Wait();
                               (*out)[0] = value;
                               written_.store(true);
                             })
                    .ok());
  }

  CpuDevice device_;
  std::unique_ptr<Stream> stream_;
  std::atomic<bool> written_{false};
};

TEST_F(StreamFenceTest, DestructionWaitsForQueuedWork) {
  Gate gate;
  {
    auto owned = std::make_unique<std::vector<int>>(1, 0);
    StreamFence fence(*stream_);  // destroyed before `owned`
    QueueWrite(gate, owned.get(), 7);
    DelayedOpener opener(gate, std::chrono::milliseconds(100));
  }
  // The write ran before the vector was freed (ASan would report it
  // otherwise; the flag says it ran at all before the scope ended).
  EXPECT_TRUE(written_.load());
}

TEST_F(StreamFenceTest, WaitReturnsTheStreamsFault) {
  StreamFence fence(*stream_);
  ASSERT_TRUE(static_cast<CpuStream&>(*stream_)
                  .InjectFault(absl::InternalError("illegal address"))
                  .ok());
  const absl::Status waited = fence.Wait();
  EXPECT_EQ(waited.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(waited.message(), HasSubstr("device fault: illegal address"));
}

TEST_F(StreamFenceTest, MovedFenceGuardsInItsNewPlace) {
  Gate gate;
  auto owned = std::make_unique<std::vector<int>>(1, 0);
  StreamFence member;               // a member assigned once the stream exists
  EXPECT_TRUE(member.Wait().ok());  // guards nothing yet
  member = StreamFence(*stream_);
  QueueWrite(gate, owned.get(), 3);
  {
    StreamFence moved(std::move(member));
    DelayedOpener opener(gate, std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(written_.load());
  EXPECT_EQ((*owned)[0], 3);
}

TEST_F(StreamFenceTest, AssigningWaitsForTheOldStream) {
  Gate gate;
  auto owned = std::make_unique<std::vector<int>>(1, 0);
  StreamFence fence(*stream_);
  QueueWrite(gate, owned.get(), 5);
  DelayedOpener opener(gate, std::chrono::milliseconds(100));
  fence = StreamFence();
  EXPECT_TRUE(written_.load());
}

}  // namespace
}  // namespace pdworker
