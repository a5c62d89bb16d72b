// Behaviour every runtime backend must show, written once and run on the CPU
// backend with inline and with threaded streams (runtime_conformance_test)
// and on CUDA (runtime_conformance_gpu_test).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runtime/backend_fixture.h"
#include "worker/runtime/event.h"
#include "worker/runtime/testing/test_ops.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

constexpr size_t kN = 300;  // > one 256-thread CUDA block.

// Static buffers of a small op chain: out depends only on x and w.
struct Chain {
  DeviceBuffer x, w, t1, t2, scratch, out;
};

class RuntimeConformanceTest : public BackendTest {
 protected:
  Chain NewChain() {
    Chain c;
    c.x = NewFloats(kN, "x");
    c.w = NewFloats(kN, "w");
    c.t1 = NewFloats(kN, "t1");
    c.t2 = NewFloats(kN, "t2");
    c.scratch = NewFloats(kN, "scratch");
    c.out = NewFloats(kN, "out");
    return c;
  }

  // Eight launches mixing the three test ops and a device-to-device copy.
  absl::Status RunChain(const Chain& c) {
    Stream& s = stream();
    absl::Status st = test_ops::MulAdd(s, c.x, c.w, 0.25f, c.t1);
    if (st.ok()) st = test_ops::Axpy(s, -1.5f, c.x, c.t1);
    if (st.ok()) st = test_ops::MulAdd(s, c.t1, c.t1, 1.0f, c.t2);
    if (st.ok()) st = s.CopyOnDevice(c.out, c.t2, kN * sizeof(float));
    if (st.ok()) st = test_ops::Axpy(s, 0.125f, c.t1, c.out);
    if (st.ok()) st = test_ops::Fill(s, c.scratch, 3.0f);
    if (st.ok()) st = test_ops::MulAdd(s, c.out, c.scratch, -0.5f, c.out);
    if (st.ok()) st = test_ops::Axpy(s, 2.0f, c.w, c.out);
    return st;
  }

  // The chain on the host, in double, for a tolerance check.
  static std::vector<double> Reference(const std::vector<float>& x,
                                       const std::vector<float>& w) {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double t1 = x[i] * w[i] + 0.25 - 1.5 * x[i];
      const double o = (t1 * t1 + 1.0 + 0.125 * t1) * 3.0 - 0.5 + 2.0 * w[i];
      out[i] = o;
    }
    return out;
  }

  // Fills `buffer` with a value no op in the chain produces.
  void Poison(DeviceBuffer buffer) {
    Upload(buffer, std::vector<float>(buffer.num_elements<float>(), -777.0f));
  }
};

TEST_P(RuntimeConformanceTest, EagerChainMatchesHostReference) {
  const Chain c = NewChain();
  const std::vector<float> x = Ramp(kN, -2.0f), w = Ramp(kN, 0.5f);
  Upload(c.x, x);
  Upload(c.w, w);
  ASSERT_TRUE(RunChain(c).ok());
  const std::vector<float> out = Download(c.out);
  const std::vector<double> expected = Reference(x, w);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(out[i], expected[i],
                1e-4 * std::max(1.0, std::abs(expected[i])))
        << "element " << i;
  }
}

TEST_P(RuntimeConformanceTest,
       CaptureRecordsWithoutExecutingAndReplayEqualsEager) {
  const Chain c = NewChain();
  Upload(c.x, Ramp(kN, -2.0f));
  Upload(c.w, Ramp(kN, 0.5f));
  ASSERT_TRUE(RunChain(c).ok());
  const std::vector<float> eager = Download(c.out);

  Poison(c.out);
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(RunChain(c).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  // Stream capture records; nothing ran yet.
  EXPECT_EQ(Download(c.out)[0], -777.0f);

  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_TRUE(BitIdentical(Download(c.out), eager));
  // And again: replay is repeatable.
  Poison(c.out);
  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_TRUE(BitIdentical(Download(c.out), eager));
}

TEST_P(RuntimeConformanceTest, ReplayReadsNewContentsOfStaticInputs) {
  const Chain c = NewChain();
  Upload(c.x, Ramp(kN, -2.0f));
  Upload(c.w, Ramp(kN, 0.5f));
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(RunChain(c).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  // New step: new input contents, same buffers.
  const std::vector<float> x2 = Ramp(kN, 4.0f), w2 = Ramp(kN, -1.0f);
  Upload(c.x, x2);
  Upload(c.w, w2);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> replayed = Download(c.out);

  ASSERT_TRUE(RunChain(c).ok());
  const std::vector<float> eager = Download(c.out);
  EXPECT_TRUE(BitIdentical(replayed, eager));
  const std::vector<double> expected = Reference(x2, w2);
  EXPECT_NEAR(replayed[7], expected[7], 1e-3 * std::abs(expected[7]));
}

// The graph contract, documented: a value the host computes while capturing
// (here a scale factor read from a host variable) is frozen into the graph.
// Replay does not see the new host value; only device buffers are live.
TEST_P(RuntimeConformanceTest, HostValueReadAtCaptureGoesStaleAtReplay) {
  DeviceBuffer x = NewFloats(kN, "x");
  DeviceBuffer y = NewFloats(kN, "y");
  float host_scale = 2.0f;
  auto forward = [&]() {
    absl::Status st = test_ops::Fill(stream(), y, 1.0f);
    if (st.ok()) st = test_ops::Axpy(stream(), host_scale, x, y);
    return st;
  };
  Upload(x, std::vector<float>(kN, 10.0f));
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(forward().ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  host_scale = 5.0f;
  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_EQ(Download(y)[0], 21.0f) << "replay must use the captured scale 2";
  ASSERT_TRUE(forward().ok());
  EXPECT_EQ(Download(y)[0], 51.0f) << "eager uses the current scale 5";
}

TEST_P(RuntimeConformanceTest, DeviceToDeviceCopyIsCapturable) {
  DeviceBuffer src = NewFloats(kN, "src");
  DeviceBuffer dst = NewFloats(kN, "dst");
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(stream().CopyOnDevice(dst, src, kN * sizeof(float)).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  const std::vector<float> values = Ramp(kN, 9.0f);
  Upload(src, values);
  ASSERT_TRUE((*graph)->Replay().ok());
  EXPECT_TRUE(BitIdentical(Download(dst), values));
}

// Each forbidden operation fails on its own and poisons the capture: later
// launches fail and EndCapture names the culprit; the stream then recovers.
class ForbiddenDuringCaptureTest : public RuntimeConformanceTest {
 protected:
  void SetUp() override {
    RuntimeConformanceTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    after_ = NewFloats(kN, "after");  // Allocated before any capture.
  }

  void ExpectCaptureInvalidatedBy(const std::string& culprit) {
    DeviceBuffer y = after_;
    const absl::Status launch = test_ops::Fill(stream(), y, 1.0f);
    EXPECT_EQ(launch.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(launch.message()), HasSubstr(culprit));
    absl::StatusOr<std::unique_ptr<CapturedGraph>> graph =
        stream().EndCapture();
    ASSERT_FALSE(graph.ok());
    EXPECT_EQ(graph.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(graph.status().message()), HasSubstr(culprit));
    EXPECT_FALSE(stream().IsCapturing());
    // The stream works again: eager, and a fresh capture.
    ASSERT_TRUE(test_ops::Fill(stream(), y, 4.0f).ok());
    EXPECT_EQ(Download(y)[0], 4.0f);
    ASSERT_TRUE(stream().BeginCapture().ok());
    ASSERT_TRUE(test_ops::Fill(stream(), y, 6.0f).ok());
    graph = stream().EndCapture();
    ASSERT_TRUE(graph.ok()) << graph.status();
    ASSERT_TRUE((*graph)->Replay().ok());
    EXPECT_EQ(Download(y)[0], 6.0f);
  }

  DeviceBuffer after_;
};

TEST_P(ForbiddenDuringCaptureTest, DeviceAllocation) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  absl::StatusOr<DeviceMemory> memory = device().Allocate(4096);
  ASSERT_FALSE(memory.ok());
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(memory.status().message()),
              HasSubstr("capturing a graph"));
  ExpectCaptureInvalidatedBy("Device::Allocate");
}

TEST_P(ForbiddenDuringCaptureTest, HostAllocation) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  absl::StatusOr<HostMemory> memory = device().AllocateHost(4096);
  ASSERT_FALSE(memory.ok());
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(memory.status().message()),
              HasSubstr("capturing a graph"));
  ExpectCaptureInvalidatedBy("Device::AllocateHost");
}

TEST_P(ForbiddenDuringCaptureTest, ArenaAllocation) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  const size_t used = arena().used_bytes();
  absl::StatusOr<DeviceBuffer> buffer = arena().Allocate(64, "late");
  ASSERT_FALSE(buffer.ok());
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(arena().used_bytes(), used);
  ExpectCaptureInvalidatedBy("Allocate('late')");
}

TEST_P(ForbiddenDuringCaptureTest, CreateStreamAndEvent) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(device().CreateEvent().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device().CreateStream().status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The first refusal is the one reported.
  ExpectCaptureInvalidatedBy("Device::CreateEvent");
}

TEST_P(ForbiddenDuringCaptureTest, Synchronize) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status = stream().Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("capturing a graph"));
  ExpectCaptureInvalidatedBy("Stream::Synchronize");
}

TEST_P(ForbiddenDuringCaptureTest, CopyToHost) {
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE(stream().BeginCapture().ok());
  std::vector<float> host(kN);
  const absl::Status status =
      stream().CopyToHost(host.data(), x, kN * sizeof(float));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  ExpectCaptureInvalidatedBy("Stream::CopyToHost");
}

TEST_P(ForbiddenDuringCaptureTest, CopyToHostAsync) {
  DeviceBuffer x = NewFloats(kN, "x");
  absl::StatusOr<HostMemory> host = device().AllocateHost(kN * sizeof(float));
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status =
      stream().CopyToHostAsync(host->data(), x, kN * sizeof(float));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("capturing a graph"));
  ExpectCaptureInvalidatedBy("Stream::CopyToHostAsync");
}

TEST_P(ForbiddenDuringCaptureTest, CopyToDevice) {
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE(stream().BeginCapture().ok());
  const std::vector<float> host(kN, 1.0f);
  const absl::Status status =
      stream().CopyToDevice(x, host.data(), kN * sizeof(float));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("static buffers"));
  ExpectCaptureInvalidatedBy("Stream::CopyToDevice");
}

TEST_P(ForbiddenDuringCaptureTest, CopyToDeviceAsync) {
  DeviceBuffer x = NewFloats(kN, "x");
  absl::StatusOr<HostMemory> host = device().AllocateHost(kN * sizeof(float));
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status status =
      stream().CopyToDeviceAsync(x, *host, kN * sizeof(float));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("static buffers"));
  ExpectCaptureInvalidatedBy("Stream::CopyToDeviceAsync");
}

TEST_P(ForbiddenDuringCaptureTest, RecordEvent) {
  absl::StatusOr<std::unique_ptr<Event>> event = device().CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status();
  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ(stream().RecordEvent(**event).code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectCaptureInvalidatedBy("Stream::RecordEvent");
}

TEST_P(ForbiddenDuringCaptureTest, ReplayingAnotherGraph) {
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(test_ops::Fill(stream(), x, 2.0f).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> inner = stream().EndCapture();
  ASSERT_TRUE(inner.ok()) << inner.status();

  ASSERT_TRUE(stream().BeginCapture().ok());
  EXPECT_EQ((*inner)->Replay().code(), absl::StatusCode::kFailedPrecondition);
  ExpectCaptureInvalidatedBy("CapturedGraph::Replay");
}

// Device-wide refusals reach a capture running on another thread (the
// registry is shared); run under --config=tsan.
TEST_P(RuntimeConformanceTest, AllocationOnAnotherThreadInvalidatesCapture) {
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE(stream().BeginCapture().ok());
  absl::Status from_other_thread;
  std::thread other(
      [&] { from_other_thread = device().Allocate(1024).status(); });
  for (int i = 0; i < 100; ++i) {
    // Launches race with the invalidation: either recorded or refused.
    (void)test_ops::Fill(stream(), x, 1.0f);
  }
  other.join();
  EXPECT_EQ(from_other_thread.code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_FALSE(graph.ok());
  EXPECT_THAT(std::string(graph.status().message()),
              HasSubstr("Device::Allocate"));
}

TEST_P(RuntimeConformanceTest, NestedBeginCaptureIsRejected) {
  ASSERT_TRUE(stream().BeginCapture().ok());
  const absl::Status nested = stream().BeginCapture();
  EXPECT_EQ(nested.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(nested.message()), HasSubstr("already capturing"));
  // The outer capture is unharmed.
  EXPECT_TRUE(stream().EndCapture().ok());
}

TEST_P(RuntimeConformanceTest, EndCaptureWithoutBeginIsRejected) {
  EXPECT_EQ(stream().EndCapture().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(RuntimeConformanceTest, StreamDestroyedWhileCapturingReleasesDevice) {
  absl::StatusOr<std::unique_ptr<Stream>> second = device().CreateStream();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->BeginCapture().ok());
  EXPECT_FALSE(device().Allocate(256).ok());  // Refused while capturing.
  second->reset();
  // No stream is capturing any more: allocation works again.
  EXPECT_TRUE(device().Allocate(256).ok());
}

TEST_P(RuntimeConformanceTest, ArenaExhaustionIsACleanError) {
  ArenaOptions options;
  options.capacity_bytes = 4096;
  options.alignment_bytes = 256;
  options.name = "small";
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      Arena::Create(device(), options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ASSERT_TRUE((*arena)->Allocate(3000, "a").ok());
  const size_t used = (*arena)->used_bytes();
  absl::StatusOr<DeviceBuffer> too_big = (*arena)->Allocate(1100, "b");
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_big.status().message()),
              HasSubstr("arena 'small' exhausted"));
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("'b'"));
  EXPECT_EQ((*arena)->used_bytes(), used)
      << "a failed allocation changes nothing";
  // 3000 rounds up to offset 3072; 1024 bytes remain.
  absl::StatusOr<DeviceBuffer> fits = (*arena)->Allocate(1024, "c");
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ((*arena)->free_bytes(), 0u);
}

TEST_P(RuntimeConformanceTest, ArenaBuffersAreAlignedAndDisjoint) {
  absl::StatusOr<DeviceBuffer> a = arena().Allocate(10, "a");
  absl::StatusOr<DeviceBuffer> b = arena().Allocate(10, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
  EXPECT_GE(static_cast<char*>(b->data()) - static_cast<char*>(a->data()), 10);
  EXPECT_EQ(arena().Allocate(0, "empty").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(RuntimeConformanceTest, CopiesCheckBufferBounds) {
  DeviceBuffer x = NewFloats(4, "x");
  std::vector<float> host(8, 1.0f);
  EXPECT_EQ(stream().CopyToDevice(x, host.data(), 8 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream().CopyToHost(host.data(), x, 8 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream().CopyToHostAsync(host.data(), x, 8 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream().CopyToHostAsync(nullptr, x, 4 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
}

// The engine's read-back: results go to pinned memory without blocking the
// host, and an event recorded after the copy says when they are there.
TEST_P(RuntimeConformanceTest, CopyToHostAsyncDeliversBytesAtItsEvent) {
  DeviceBuffer x = NewFloats(kN, "x");
  absl::StatusOr<HostMemory> host = device().AllocateHost(kN * sizeof(float));
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<Event>> copied = device().CreateEvent();
  ASSERT_TRUE(copied.ok()) << copied.status();
  const std::vector<float> values = Ramp(kN, 3.0f);
  Upload(x, values);
  ASSERT_TRUE(test_ops::Axpy(stream(), 1.0f, x, x).ok());  // x = 2 * values
  ASSERT_TRUE(
      stream().CopyToHostAsync(host->data(), x, kN * sizeof(float)).ok());
  ASSERT_TRUE(stream().RecordEvent(**copied).ok());
  ASSERT_TRUE((*copied)->Synchronize().ok());
  absl::StatusOr<bool> done = (*copied)->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(host->as<float>()[i], 2.0f * values[i]) << "element " << i;
  }
  // Reusable: a second step into the same pinned buffer, same event.
  ASSERT_TRUE(test_ops::Fill(stream(), x, -4.0f).ok());
  ASSERT_TRUE(
      stream().CopyToHostAsync(host->data(), x, kN * sizeof(float)).ok());
  ASSERT_TRUE(stream().RecordEvent(**copied).ok());
  ASSERT_TRUE((*copied)->Synchronize().ok());
  EXPECT_EQ(host->as<float>()[kN - 1], -4.0f);
}

// Six uploads through a ring of two pinned blocks, each followed by device
// work on what it copied, nothing waited for in between: every step must see
// its own bytes (the ring waits before handing out a block whose copy has
// not run; on the threaded CPU stream and CUDA the copies run later).
TEST_P(RuntimeConformanceTest, UploadRingStepsSeeTheirOwnBytes) {
  absl::StatusOr<std::unique_ptr<UploadRing>> ring =
      UploadRing::Create(device(), kN * sizeof(float), 2);
  ASSERT_TRUE(ring.ok()) << ring.status();
  constexpr int kSteps = 6;
  std::vector<DeviceBuffer> staged, doubled;
  for (int step = 0; step < kSteps; ++step) {
    staged.push_back(NewFloats(kN, "staged"));
    doubled.push_back(NewFloats(kN, "doubled"));
    absl::StatusOr<void*> block = (*ring)->Next();
    ASSERT_TRUE(block.ok()) << block.status();
    const std::vector<float> values = Ramp(kN, 10.0f * step);
    std::memcpy(*block, values.data(), kN * sizeof(float));
    ASSERT_TRUE(
        (*ring)->Upload(stream(), staged[step], kN * sizeof(float)).ok());
    ASSERT_TRUE(test_ops::Fill(stream(), doubled[step], 0.0f).ok());
    ASSERT_TRUE(
        test_ops::Axpy(stream(), 2.0f, staged[step], doubled[step]).ok());
  }
  for (int step = 0; step < kSteps; ++step) {
    const std::vector<float> values = Ramp(kN, 10.0f * step);
    const std::vector<float> got = Download(doubled[step]);
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(got[i], 2.0f * values[i])
          << "step " << step << " element " << i;
    }
  }
}

TEST_P(RuntimeConformanceTest, UploadRingRefusesMoreThanABlock) {
  absl::StatusOr<std::unique_ptr<UploadRing>> ring =
      UploadRing::Create(device(), sizeof(float), 1);
  ASSERT_TRUE(ring.ok()) << ring.status();
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE((*ring)->Next().ok());
  EXPECT_EQ((*ring)->Upload(stream(), x, 2 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UploadRing::Create(device(), 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(RuntimeConformanceTest, UnrecordedEventCannotBeWaitedFor) {
  absl::StatusOr<std::unique_ptr<Event>> event = device().CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ((*event)->Synchronize().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*event)->Query().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(RuntimeConformanceTest, HostMemoryIsAlignedWritableAndMovable) {
  EXPECT_EQ(device().AllocateHost(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<HostMemory> memory = device().AllocateHost(1000);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_EQ(memory->size_bytes(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(memory->data()) % 64, 0u);
  std::memset(memory->data(), 0x5A, 1000);
  void* const data = memory->data();
  HostMemory moved = *std::move(memory);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.as<unsigned char>()[999], 0x5A);
  moved.Reset();
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_EQ(moved.size_bytes(), 0u);
}

TEST_P(RuntimeConformanceTest, EventsTimeStreamWork) {
  absl::StatusOr<std::unique_ptr<Event>> start = device().CreateEvent();
  absl::StatusOr<std::unique_ptr<Event>> end = device().CreateEvent();
  ASSERT_TRUE(start.ok() && end.ok());
  EXPECT_EQ((*end)->ElapsedMillisecondsSince(**start).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "unrecorded events have no time";
  DeviceBuffer x = NewFloats(kN, "x");
  ASSERT_TRUE(stream().RecordEvent(**start).ok());
  for (int i = 0; i < 50; ++i)
    ASSERT_TRUE(test_ops::Fill(stream(), x, 1.0f).ok());
  ASSERT_TRUE(stream().RecordEvent(**end).ok());
  absl::StatusOr<double> elapsed = (*end)->ElapsedMillisecondsSince(**start);
  ASSERT_TRUE(elapsed.ok()) << elapsed.status();
  EXPECT_GE(*elapsed, 0.0);
  EXPECT_LT(*elapsed, 10000.0);
}

TEST_P(RuntimeConformanceTest, MemoryStatsSeeAllocations) {
  absl::StatusOr<MemoryStats> before = device().GetMemoryStats();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->used_bytes + before->free_bytes, before->total_bytes);
  constexpr size_t kBytes = size_t{64} << 20;
  absl::StatusOr<DeviceMemory> memory = device().Allocate(kBytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<MemoryStats> during = device().GetMemoryStats();
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_GE(during->used_bytes, before->used_bytes + kBytes);
  memory->Reset();
  absl::StatusOr<MemoryStats> after = device().GetMemoryStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_LT(after->used_bytes, during->used_bytes);
}

PDW_INSTANTIATE_BACKEND_TESTS_WITH_THREADED_CPU(RuntimeConformanceTest);
PDW_INSTANTIATE_BACKEND_TESTS_WITH_THREADED_CPU(ForbiddenDuringCaptureTest);

}  // namespace
}  // namespace pdworker
