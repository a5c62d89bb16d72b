// Failures of the P/D handoff with real worker processes (//worker:pdworker)
// that are stopped, killed and restarted mid-handoff. Each case ends with the
// documented status, within its bound, and with zero KV blocks held on every
// worker that is still alive.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"
#include "tests/transfer/handoff_test_util.h"
#include "tests/transfer/worker_process.h"

namespace pdworker {
namespace {

using handoff_testing::Import;
using handoff_testing::TmpPath;
using handoff_testing::WorkerProcess;
using server_testing::Input;
using server_testing::Request;
using server_testing::RunfilePath;
using server_testing::StartWorker;
using server_testing::TestWorker;
using server_testing::TinyModelDir;
using server_testing::WaitFor;
using ::testing::HasSubstr;

using Clock = std::chrono::steady_clock;

std::unique_ptr<WorkerProcess> StartProcess(const std::string& role,
                                            const std::string& log_name,
                                            std::vector<std::string> extra) {
  std::vector<std::string> flags = {
      "--model=" + TinyModelDir(),
      "--role=" + role,
      "--max_num_seqs=4",
      "--max_num_batched_tokens=32",
      "--max_model_len=64",
      "--kv_cache_bytes=65536",
      "--block_size=4",
      "--stats_log_interval=0",
  };
  flags.insert(flags.end(), extra.begin(), extra.end());
  return handoff_testing::StartWorkerProcess(RunfilePath("worker/pdworker"),
                                             flags, TmpPath(log_name));
}

// start + hold_for_handoff on `prefill`; the handle.
// start + hold_for_handoff of a `len`-token prompt; the handle.
v1::KvHandle Hold(v1::Worker::Stub& prefill, const std::string& id, int len) {
  std::vector<int32_t> prompt(len);
  for (int i = 0; i < len; ++i) prompt[i] = (11 * i + id.size()) % 256;
  return handoff_testing::HandleOf(handoff_testing::Hold(prefill, id, prompt));
}

// A fresh 9-token prompt held on `prefill`, imported by `decode`, and one
// decode step that ends the sequence: both workers serve end to end.
void HandOffOneRequest(v1::Worker::Stub& prefill, v1::Worker::Stub& decode,
                       const std::string& id) {
  const v1::KvHandle handle = Hold(prefill, id, 9);
  ASSERT_TRUE(Import(decode, id, handle).ok());
  v1::SequenceInput step = Input(id, {5}, false);
  step.set_release_after_step(true);
  v1::ForwardResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(decode.Forward(&context, Request({step}), &response).ok());
  EXPECT_EQ(response.sequences(0).num_tokens(), 10);
}

bool Empty(const v1::WorkerStatus& s) {
  return handoff_testing::HoldsNothing(s);
}

// An in-process decode worker whose pulls give up after 2 s.
std::unique_ptr<TestWorker> StartDecode() {
  ModelRunnerOptions o = server_testing::SmallRunnerOptions();
  o.role = Role::kDecode;
  o.compilation = CompilationConfig{};
  o.compilation.cudagraph_capture_sizes = std::vector<int>{1, 2, 4};
  WorkerServerOptions s;
  s.importer.pull_timeout = std::chrono::milliseconds(2000);
  return StartWorker(o, s);
}

// The prefill worker freezes (SIGSTOP) while the decode worker pulls, then
// dies (SIGKILL): the import fails with UNAVAILABLE soon after the death, and
// the decode worker frees the blocks it had reserved.
TEST(KvFaultTest, PrefillKilledDuringPull) {
  auto prefill = StartProcess("prefill", "killed_prefill.log", {});
  ASSERT_NE(prefill, nullptr);
  std::unique_ptr<TestWorker> decode = StartDecode();
  ASSERT_FALSE(HasFatalFailure());
  const v1::KvHandle handle = Hold(*prefill->stub, "k", 40);
  ASSERT_FALSE(handle.lease_id().empty());

  prefill->process->Signal(SIGSTOP);
  auto import = std::async(std::launch::async,
                           [&] { return Import(*decode->stub, "k", handle); });
  // The pull is under way (blocks reserved, stream open, no data).
  ASSERT_TRUE(WaitFor([&] { return decode->Status().kv_imports() == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto killed = Clock::now();
  prefill->process->Signal(SIGKILL);
  const grpc::Status s = import.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(handle.source_address()));
  // Within the pull timeout (2 s) of the kill, with slack for a loaded CI.
  EXPECT_LT(Clock::now() - killed, std::chrono::seconds(4));
  ASSERT_TRUE(WaitFor([&] { return Empty(decode->Status()); }))
      << decode->Status().DebugString();
}

// A prefill worker that hangs (SIGSTOP) never answers the pull: the import
// fails with UNAVAILABLE after the pull timeout, not the caller's deadline.
// Once it resumes, its lease (never pulled) expires and frees the blocks.
TEST(KvFaultTest, HungPrefillFailsThePullWithinItsTimeout) {
  auto prefill =
      StartProcess("prefill", "hung_prefill.log", {"--kv_lease_ttl=3s"});
  ASSERT_NE(prefill, nullptr);
  std::unique_ptr<TestWorker> decode = StartDecode();
  ASSERT_FALSE(HasFatalFailure());
  const v1::KvHandle handle = Hold(*prefill->stub, "h", 20);

  prefill->process->Signal(SIGSTOP);
  const auto start = Clock::now();
  const grpc::Status s = Import(*decode->stub, "h", handle);
  const auto took = Clock::now() - start;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_GE(took, std::chrono::milliseconds(1900));
  EXPECT_LT(took, std::chrono::seconds(6));
  EXPECT_TRUE(Empty(decode->Status())) << decode->Status().DebugString();

  prefill->process->Signal(SIGCONT);
  ASSERT_TRUE(WaitFor([&] { return Empty(prefill->Status()); }))
      << prefill->Status().DebugString();
}

// The decode worker dies (mid-import and with a sequence it had imported)
// and comes back on a new port: the prefill worker's leases expire and free
// every block; the restarted decode worker knows nothing of the old
// sequence (NOT_FOUND) and imports new handoffs normally.
TEST(KvFaultTest, DecodeRestartsWhilePrefillHoldsLeases) {
  auto prefill =
      StartProcess("prefill", "restart_prefill.log", {"--kv_lease_ttl=2s"});
  ASSERT_NE(prefill, nullptr);
  auto decode = StartProcess("decode", "restart_decode_1.log", {});
  ASSERT_NE(decode, nullptr);

  const v1::KvHandle imported = Hold(*prefill->stub, "a", 12);
  ASSERT_TRUE(Import(*decode->stub, "a", imported).ok());
  const v1::KvHandle held1 = Hold(*prefill->stub, "b", 30);
  const v1::KvHandle held2 = Hold(*prefill->stub, "c", 7);
  auto racing = std::async(std::launch::async,
                           [&] { return Import(*decode->stub, "b", held1); });
  decode->process->Signal(SIGKILL);
  racing.get();  // whatever it was; the process is gone
  ASSERT_TRUE(decode->process->Wait(absl::Seconds(10)).ok());
  decode.reset();

  // Leases nobody released expire (2 s) and free the prefill worker.
  ASSERT_TRUE(WaitFor([&] { return Empty(prefill->Status()); }))
      << prefill->Status().DebugString();
  EXPECT_EQ(Import(*StartDecode()->stub, "c", held2).error_code(),
            grpc::StatusCode::NOT_FOUND);

  auto restarted = StartProcess("decode", "restart_decode_2.log", {});
  ASSERT_NE(restarted, nullptr);
  {
    v1::ForwardResponse response;
    grpc::ClientContext context;
    const grpc::Status s = restarted->stub->Forward(
        &context, Request({Input("a", {1}, false)}), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  }
  HandOffOneRequest(*prefill->stub, *restarted->stub, "d");
  ASSERT_TRUE(WaitFor([&] { return Empty(prefill->Status()); }));
  ASSERT_TRUE(WaitFor([&] { return Empty(restarted->Status()); }));
}

// The router dies (SIGKILL) mid-load, abandoning requests in every state:
// prefilled and held, imported, mid-decode. Nobody will ever release them;
// lease expiry frees the prefill worker and the idle-sequence sweep
// (--sequence_idle_timeout) the decode worker, and both keep serving.
TEST(KvFaultTest, RouterKilledMidLoadLeavesNoKvBehind) {
  auto prefill =
      StartProcess("prefill", "router_kill_prefill.log",
                   {"--kv_lease_ttl=2s", "--sequence_idle_timeout=2s"});
  ASSERT_NE(prefill, nullptr);
  auto decode = StartProcess("decode", "router_kill_decode.log",
                             {"--sequence_idle_timeout=2s"});
  ASSERT_NE(decode, nullptr);

  auto router = server_testing::Subprocess::Start(
      {RunfilePath("tools/router/router"),
       absl::StrCat("--prefill=127.0.0.1:", prefill->port),
       absl::StrCat("--decode=127.0.0.1:", decode->port), "--load_requests=200",
       "--load_rate=50", "--load_prompt_len=8-24", "--max_tokens=30",
       "--timings=false"},
      TmpPath("router_kill_router.log"));
  ASSERT_TRUE(router.ok()) << router.status();
  // Kill it once the decode worker is decoding for it.
  ASSERT_TRUE(WaitFor([&] { return decode->Status().num_sequences() > 0; }))
      << (*router)->Output();
  (*router)->Signal(SIGKILL);
  ASSERT_TRUE((*router)->Wait(absl::Seconds(10)).ok());
  const auto killed = Clock::now();
  const v1::WorkerStatus orphaned = decode->Status();
  EXPECT_GT(orphaned.num_sequences(), 0);
  EXPECT_LT(orphaned.kv_blocks_free(), orphaned.kv_blocks_total());

  ASSERT_TRUE(WaitFor([&] { return Empty(decode->Status()); }))
      << decode->Status().DebugString();
  ASSERT_TRUE(WaitFor([&] { return Empty(prefill->Status()); }))
      << prefill->Status().DebugString();
  // 2 s timeout + its sweep period (0.2 s), with slack for a loaded CI.
  EXPECT_LT(Clock::now() - killed, std::chrono::seconds(8));
  EXPECT_THAT(decode->process->Output(), HasSubstr("without a step"));

  // Both still serve a whole request.
  HandOffOneRequest(*prefill->stub, *decode->stub, "after");
  ASSERT_TRUE(WaitFor([&] { return Empty(prefill->Status()); }));
  ASSERT_TRUE(WaitFor([&] { return Empty(decode->Status()); }));
}

}  // namespace
}  // namespace pdworker
