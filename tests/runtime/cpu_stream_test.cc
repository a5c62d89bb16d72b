// The CPU stream's execution modes: the threaded stream runs work on its own
// thread, in order, as a GPU runs a CUDA stream (so host/device overlap and
// its races show up without a GPU), and the injected device fault that the
// engine's error path is tested with. Backend-neutral behaviour is in
// runtime_conformance_test, which also runs on threaded CPU streams.
#include "worker/runtime/cpu_stream.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/event.h"
#include "worker/runtime/host_memory.h"
#include "worker/runtime/testing/stream_gate.h"
#include "worker/runtime/testing/test_ops.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {
namespace {

using testing::DelayedOpener;
using ::testing::ElementsAreArray;
using testing::Gate;
using ::testing::HasSubstr;

constexpr size_t kN = 64;
// How long a helper thread lets the test thread block before opening a gate.
constexpr std::chrono::milliseconds kOpenDelay{30};

class CpuStreamTest : public ::testing::TestWithParam<CpuStreamExecution> {
 protected:
  void SetUp() override {
    CpuDeviceOptions options;
    options.stream_execution = GetParam();
    device_ = std::make_unique<CpuDevice>(options);
    stream_ = NewStream();
    ASSERT_NE(stream_, nullptr);
  }

  std::unique_ptr<CpuStream> NewStream() {
    absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (!stream.ok()) return nullptr;
    auto* cpu = dynamic_cast<CpuStream*>(stream->get());
    EXPECT_NE(cpu, nullptr);
    EXPECT_EQ(cpu->execution(), GetParam());
    stream->release();
    return std::unique_ptr<CpuStream>(cpu);
  }

  CpuStream& stream() { return *stream_; }

  DeviceBuffer NewFloats(size_t n) {
    absl::StatusOr<DeviceMemory> memory = device_->Allocate(n * sizeof(float));
    EXPECT_TRUE(memory.ok()) << memory.status();
    memories_.push_back(*std::move(memory));
    return memories_.back().buffer();
  }

  std::unique_ptr<Event> NewEvent() {
    absl::StatusOr<std::unique_ptr<Event>> event = device_->CreateEvent();
    EXPECT_TRUE(event.ok()) << event.status();
    return event.ok() ? *std::move(event) : nullptr;
  }

  // Holds `stream` until `gate` opens; *timed_out tells whether it gave up.
  static absl::Status BlockOn(Stream& stream, Gate& gate,
                              std::atomic<bool>* timed_out) {
    return stream.Launch("wait_for_gate", [&gate, timed_out](const OpContext&) {
      if (!gate.Wait()) timed_out->store(true);
    });
  }

  std::vector<float> Download(DeviceBuffer src) {
    std::vector<float> values(src.num_elements<float>());
    const absl::Status status =
        stream().CopyToHost(values.data(), src, src.size_bytes());
    EXPECT_TRUE(status.ok()) << status;
    return values;
  }

  // The CPU backend's device memory is host memory: read it directly, once
  // the stream has finished with it (e.g. after a Synchronize that returned
  // a fault, when CopyToHost cannot be used).
  static std::vector<float> Peek(DeviceBuffer src) {
    return std::vector<float>(src.as<float>(),
                              src.as<float>() + src.num_elements<float>());
  }

  // Declaration order: the streams go first (finishing their queued work,
  // which writes into memories_), the device last.
  std::unique_ptr<CpuDevice> device_;
  std::vector<DeviceMemory> memories_;
  std::unique_ptr<CpuStream> stream_;
};

using ThreadedCpuStreamTest = CpuStreamTest;
using CpuStreamFaultTest = CpuStreamTest;

TEST_P(ThreadedCpuStreamTest, LaunchReturnsBeforeTheOpRunsAndOpsRunInOrder) {
  Gate gate;
  std::atomic<bool> timed_out{false};
  std::atomic<int> ran{0};
  // Written on the stream's thread only; read after Synchronize.
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  constexpr int kOps = 20;
  for (int i = 0; i < kOps; ++i) {
    ASSERT_TRUE(stream()
                    .Launch("append",
                            [&, i](const OpContext&) {
                              order.push_back(i);
                              threads.push_back(std::this_thread::get_id());
                              ran.fetch_add(1);
                            })
                    .ok());
  }
  // Every Launch returned while the first op still holds the stream: an
  // inline stream would have blocked in the first Launch until the timeout.
  EXPECT_EQ(ran.load(), 0);
  gate.Open();
  ASSERT_TRUE(stream().Synchronize().ok());
  EXPECT_FALSE(timed_out.load()) << "Launch blocked the caller";
  std::vector<int> expected(kOps);
  for (int i = 0; i < kOps; ++i) expected[i] = i;
  EXPECT_THAT(order, ElementsAreArray(expected));
  ASSERT_EQ(threads.size(), static_cast<size_t>(kOps));
  EXPECT_NE(threads[0], std::this_thread::get_id());
  for (const std::thread::id& id : threads) EXPECT_EQ(id, threads[0]);
}

TEST_P(ThreadedCpuStreamTest, CopyToDeviceStagesTheSourceAtTheCall) {
  DeviceBuffer x = NewFloats(kN);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  std::vector<float> host(kN, 1.5f);
  ASSERT_TRUE(stream().CopyToDevice(x, host.data(), x.size_bytes()).ok());
  // The caller reuses its buffer at once; the copy has not run yet.
  std::fill(host.begin(), host.end(), -9.0f);
  gate.Open();
  EXPECT_EQ(Download(x), std::vector<float>(kN, 1.5f));
  EXPECT_FALSE(timed_out.load());
}

// The pinned copy is not staged: it reads the source when the stream
// reaches it, as a DMA does, so a host that rewrites the source before an
// event after the copy completes gets the new bytes here too.
TEST_P(ThreadedCpuStreamTest, CopyToDeviceAsyncReadsTheSourceWhenItRuns) {
  DeviceBuffer x = NewFloats(kN);
  absl::StatusOr<HostMemory> host = device_->AllocateHost(x.size_bytes());
  ASSERT_TRUE(host.ok()) << host.status();
  std::fill_n(host->as<float>(), kN, 1.5f);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE(stream().CopyToDeviceAsync(x, *host, x.size_bytes()).ok());
  std::fill_n(host->as<float>(), kN, -9.0f);
  gate.Open();
  EXPECT_EQ(Download(x), std::vector<float>(kN, -9.0f));
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, CopyToDeviceAsyncRefusesMoreThanTheSource) {
  DeviceBuffer x = NewFloats(kN);
  absl::StatusOr<HostMemory> host = device_->AllocateHost(sizeof(float));
  ASSERT_TRUE(host.ok()) << host.status();
  const absl::Status status =
      stream().CopyToDeviceAsync(x, *host, x.size_bytes());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("host source"), absl::string_view::npos)
      << status;
}

TEST_P(ThreadedCpuStreamTest, CopyToHostAsyncLandsWhenTheStreamReachesIt) {
  DeviceBuffer x = NewFloats(kN);
  absl::StatusOr<HostMemory> host = device_->AllocateHost(x.size_bytes());
  ASSERT_TRUE(host.ok()) << host.status();
  std::unique_ptr<Event> copied = NewEvent();
  ASSERT_NE(copied, nullptr);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 7.0f).ok());
  ASSERT_TRUE(stream().CopyToHostAsync(host->data(), x, x.size_bytes()).ok());
  ASSERT_TRUE(stream().RecordEvent(*copied).ok());

  absl::StatusOr<bool> done = copied->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done) << "the stream is held before the copy";
  // Still the poison AllocateHost wrote (no write can race: the stream is
  // held).
  EXPECT_EQ(host->as<uint32_t>()[0], 0xFFFFFFFFu);

  gate.Open();
  ASSERT_TRUE(copied->Synchronize().ok());
  done = copied->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(host->as<float>()[i], 7.0f) << i;
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, EventsTimeStreamWorkNotHostCalls) {
  std::unique_ptr<Event> start = NewEvent();
  std::unique_ptr<Event> end = NewEvent();
  ASSERT_TRUE(start != nullptr && end != nullptr);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(stream().RecordEvent(*start).ok());
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE(stream().RecordEvent(*end).ok());
  // `start` is reached before the gate; `end` only after it opens, at least
  // kOpenDelay later, although both were recorded back to back on the host.
  ASSERT_TRUE(start->Synchronize().ok());
  std::this_thread::sleep_for(kOpenDelay);
  gate.Open();
  absl::StatusOr<double> elapsed = end->ElapsedMillisecondsSince(*start);
  ASSERT_TRUE(elapsed.ok()) << elapsed.status();
  EXPECT_GE(*elapsed, static_cast<double>(kOpenDelay.count()));
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, RecordingAgainMovesTheEvent) {
  std::unique_ptr<Event> event = NewEvent();
  ASSERT_NE(event, nullptr);
  ASSERT_TRUE(stream().RecordEvent(*event).ok());
  ASSERT_TRUE(event->Synchronize().ok());
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE(stream().RecordEvent(*event).ok());
  absl::StatusOr<bool> done = event->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done) << "waits refer to the latest record";
  gate.Open();
  ASSERT_TRUE(event->Synchronize().ok());
  EXPECT_TRUE(*event->Query());
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, GraphReplaysOnTheWorkerThreadLikeEager) {
  DeviceBuffer x = NewFloats(kN), y = NewFloats(kN), out = NewFloats(kN);
  std::thread::id eager_thread, replay_thread;
  std::thread::id* ran_on = &eager_thread;
  auto forward = [&]() {
    absl::Status st = test_ops::MulAdd(stream(), x, x, 0.5f, y);
    if (st.ok()) st = test_ops::Axpy(stream(), -2.0f, y, x);
    if (st.ok()) st = stream().CopyOnDevice(out, x, x.size_bytes());
    if (st.ok()) st = test_ops::MulAdd(stream(), out, y, 0.25f, out);
    if (st.ok()) {
      st = stream().Launch("where", [ran_on](const OpContext&) {
        *ran_on = std::this_thread::get_id();
      });
    }
    return st;
  };
  const std::vector<float> input(kN, 0.75f);
  ASSERT_TRUE(stream().CopyToDevice(x, input.data(), x.size_bytes()).ok());
  ASSERT_TRUE(forward().ok());
  const std::vector<float> eager = Download(out);

  ran_on = &replay_thread;
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(forward().ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  const std::vector<float> poison(kN, -777.0f);
  ASSERT_TRUE(stream().CopyToDevice(x, input.data(), x.size_bytes()).ok());
  ASSERT_TRUE(stream().CopyToDevice(out, poison.data(), x.size_bytes()).ok());
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE((*graph)->Replay().ok()) << "returns while the stream is held";
  // A replay still queued keeps its ops: the graph may go.
  graph->reset();
  gate.Open();
  const std::vector<float> replayed = Download(out);
  EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), x.size_bytes()), 0)
      << "replay must be bit-identical to eager";
  EXPECT_NE(eager[0], -777.0f);
  EXPECT_NE(replay_thread, std::this_thread::get_id());
  EXPECT_EQ(replay_thread, eager_thread);
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, SynchronizeAndCopyToHostWaitForEverything) {
  DeviceBuffer x = NewFloats(kN);
  int counter = 0;  // Plain int: only a real wait orders it for TSan.
  constexpr int kOps = 100;
  {
    Gate gate;
    std::atomic<bool> timed_out{false};
    ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
    for (int i = 0; i < kOps; ++i) {
      ASSERT_TRUE(
          stream()
              .Launch("count", [&counter](const OpContext&) { ++counter; })
              .ok());
    }
    DelayedOpener opener(gate, kOpenDelay);
    ASSERT_TRUE(stream().Synchronize().ok());
    EXPECT_EQ(counter, kOps);
    EXPECT_FALSE(timed_out.load());
  }
  {
    Gate gate;
    std::atomic<bool> timed_out{false};
    ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
    ASSERT_TRUE(test_ops::Fill(stream(), x, 2.5f).ok());
    DelayedOpener opener(gate, kOpenDelay);
    EXPECT_EQ(Download(x), std::vector<float>(kN, 2.5f));
    EXPECT_FALSE(timed_out.load());
  }
}

TEST_P(ThreadedCpuStreamTest, DestructionFinishesQueuedWork) {
  DeviceBuffer x = NewFloats(kN);
  std::unique_ptr<CpuStream> second = NewStream();
  ASSERT_NE(second, nullptr);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(*second, gate, &timed_out).ok());
  ASSERT_TRUE(test_ops::Fill(*second, x, 5.0f).ok());
  {
    DelayedOpener opener(gate, kOpenDelay);
    second.reset();  // Blocks until the gate opens and the fill ran.
  }
  EXPECT_EQ(Peek(x), std::vector<float>(kN, 5.0f));
  EXPECT_FALSE(timed_out.load());
}

// An upload ring whose copy is queued but whose event cannot be recorded
// (a launch error) must not hand that block out while the copy still reads
// it: Upload returns the error only once the copy has run.
TEST_P(ThreadedCpuStreamTest, UploadRingWaitsForACopyItCouldNotMark) {
  absl::StatusOr<std::unique_ptr<UploadRing>> ring =
      UploadRing::Create(*device_, kN * sizeof(float), 1);
  ASSERT_TRUE(ring.ok()) << ring.status();
  DeviceBuffer x = NewFloats(kN);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  auto* block = static_cast<float*>(*(*ring)->Next());
  std::fill(block, block + kN, 4.0f);
  // Pass the copy, fail the event record behind it.
  ASSERT_TRUE(stream().FailEnqueue(1, absl::InternalError("record")).ok());
  {
    DelayedOpener opener(gate, kOpenDelay);
    const absl::Status uploaded =
        (*ring)->Upload(stream(), x, kN * sizeof(float));
    EXPECT_EQ(uploaded.code(), absl::StatusCode::kInternal);
    // The copy ran before Upload returned (not merely before the opener
    // is joined): the block may be rewritten now.
    EXPECT_EQ(Peek(x), std::vector<float>(kN, 4.0f));
  }
  auto* again = static_cast<float*>(*(*ring)->Next());
  EXPECT_EQ(again, block);
  std::fill(again, again + kN, 5.0f);
  ASSERT_TRUE(stream().Synchronize().ok());
  EXPECT_EQ(Peek(x), std::vector<float>(kN, 4.0f));
  EXPECT_FALSE(timed_out.load());
}

TEST_P(ThreadedCpuStreamTest, WorkEnqueuedBeforeAFaultStillRuns) {
  DeviceBuffer x = NewFloats(kN);
  Gate gate;
  std::atomic<bool> timed_out{false};
  ASSERT_TRUE(BlockOn(stream(), gate, &timed_out).ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 1.0f).ok());
  ASSERT_TRUE(stream().InjectFault(absl::InternalError("boom")).ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 2.0f).ok());
  gate.Open();
  const absl::Status synced = stream().Synchronize();
  EXPECT_EQ(synced.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Peek(x), std::vector<float>(kN, 1.0f));
  EXPECT_FALSE(timed_out.load());
}

TEST_P(CpuStreamFaultTest, FaultSkipsLaterWorkAndSurfacesAtEveryWait) {
  DeviceBuffer x = NewFloats(kN);
  ASSERT_TRUE(test_ops::Fill(stream(), x, 1.0f).ok());
  ASSERT_TRUE(stream().Synchronize().ok());
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 3.0f).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  std::unique_ptr<Event> before = NewEvent(), after = NewEvent();
  ASSERT_TRUE(before != nullptr && after != nullptr);
  ASSERT_TRUE(stream().RecordEvent(*before).ok());

  ASSERT_TRUE(
      stream().InjectFault(absl::InternalError("illegal memory access")).ok());
  // Enqueueing still succeeds; the work is skipped.
  ASSERT_TRUE(test_ops::Fill(stream(), x, 2.0f).ok());
  const std::vector<float> nines(kN, 9.0f);
  ASSERT_TRUE(stream().CopyToDevice(x, nines.data(), x.size_bytes()).ok());
  ASSERT_TRUE((*graph)->Replay().ok());
  std::vector<float> async_dst(kN, -1.0f);
  ASSERT_TRUE(
      stream().CopyToHostAsync(async_dst.data(), x, x.size_bytes()).ok());
  ASSERT_TRUE(stream().RecordEvent(*after).ok());

  const absl::Status synced = stream().Synchronize();
  EXPECT_EQ(synced.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(synced.message()),
              HasSubstr("device fault: illegal memory access"));
  EXPECT_EQ(Peek(x), std::vector<float>(kN, 1.0f)) << "later work ran";
  EXPECT_EQ(async_dst, std::vector<float>(kN, -1.0f));

  EXPECT_TRUE(before->Synchronize().ok()) << "reached before the fault";
  EXPECT_EQ(after->Synchronize(), synced);
  EXPECT_EQ(after->Query().status(), synced);
  EXPECT_EQ(after->ElapsedMillisecondsSince(*before).status(), synced);

  std::vector<float> sync_dst(kN, -1.0f);
  EXPECT_EQ(stream().CopyToHost(sync_dst.data(), x, x.size_bytes()), synced);
  EXPECT_EQ(sync_dst, std::vector<float>(kN, -1.0f));

  // Sticky: no way back, and a second fault does not replace the first.
  ASSERT_TRUE(stream().InjectFault(absl::DataLossError("second")).ok());
  EXPECT_EQ(stream().Synchronize(), synced);
}

TEST_P(CpuStreamFaultTest, InjectFaultRejectsOkAndCapture) {
  EXPECT_EQ(stream().InjectFault(absl::OkStatus()).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(stream().InjectFault(absl::InternalError("x")).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(stream().EndCapture().ok()) << "the capture stays valid";
  EXPECT_TRUE(stream().Synchronize().ok()) << "nothing was injected";
}

// The hook the runner's error-path tests use: the call `n` calls after
// arming fails with the error and enqueues nothing; the calls before and
// after it enqueue as usual; captures are not counted.
TEST_P(CpuStreamFaultTest, FailEnqueueFailsExactlyTheNthCall) {
  DeviceBuffer x = NewFloats(kN);
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(stream().FailEnqueue(2, absl::InternalError("launch")).ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 3.0f).ok()) << "captured: no count";
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE(test_ops::Fill(stream(), x, 1.0f).ok());
  const std::vector<float> twos(kN, 2.0f);
  ASSERT_TRUE(stream().CopyToDevice(x, twos.data(), x.size_bytes()).ok());
  EXPECT_TRUE(stream().EnqueueFailureArmed());
  const absl::Status replay = (*graph)->Replay();
  EXPECT_EQ(replay.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(replay.message(), "launch");
  EXPECT_FALSE(stream().EnqueueFailureArmed()) << "once";
  ASSERT_TRUE(stream().Synchronize().ok()) << "not a device fault";
  EXPECT_EQ(Peek(x), twos) << "the failed replay ran nothing";
  ASSERT_TRUE((*graph)->Replay().ok());
  ASSERT_TRUE(stream().Synchronize().ok());
  EXPECT_EQ(Peek(x), std::vector<float>(kN, 3.0f));

  std::unique_ptr<Event> event = NewEvent();
  ASSERT_TRUE(event != nullptr);
  ASSERT_TRUE(stream().FailEnqueue(0, absl::UnavailableError("record")).ok());
  EXPECT_EQ(stream().RecordEvent(*event).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(event->Synchronize().ok()) << "the event was never recorded";
  ASSERT_TRUE(stream().FailEnqueue(0, absl::InternalError("x")).ok());
  stream().DisarmEnqueueFailure();
  EXPECT_TRUE(stream().RecordEvent(*event).ok());
  EXPECT_EQ(stream().FailEnqueue(0, absl::OkStatus()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream().FailEnqueue(-1, absl::InternalError("x")).code(),
            absl::StatusCode::kInvalidArgument);
}

std::string ExecutionName(
    const ::testing::TestParamInfo<CpuStreamExecution>& info) {
  return std::string(CpuStreamExecutionName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Cpu, ThreadedCpuStreamTest,
                         ::testing::Values(CpuStreamExecution::kThreaded),
                         ExecutionName);
INSTANTIATE_TEST_SUITE_P(Cpu, CpuStreamFaultTest,
                         ::testing::Values(CpuStreamExecution::kInline,
                                           CpuStreamExecution::kThreaded),
                         ExecutionName);

}  // namespace
}  // namespace pdworker
