// The P/D KV handoff between in-process workers over real gRPC on loopback:
// a prefill worker holds a prompt's KV under a lease, a decode worker
// imports it (PullKv over the gRPC stream transport) and continues the
// sequence. Tokens must equal one aggregated worker's, and no failure may
// leave a block allocated on either side.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/transfer/handoff_test_util.h"
#include "tests/transfer/in_process_handoff.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace pdworker {
namespace {

using handoff_testing::Decode;
using handoff_testing::ExpectNothingHeld;
using handoff_testing::Import;
using handoff_testing::Options;
using handoff_testing::Prefill;
using handoff_testing::Prompt;
using handoff_testing::ServerOptions;
using handoff_testing::Step;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::StartWorker;
using server_testing::TestWorker;
using server_testing::WaitFor;
using ::testing::HasSubstr;

// A loopback socket that accepts connections (the kernel's backlog) and
// never answers: a pull from it hangs until the pull timeout.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (fd_ < 0 ||
        bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
            0 ||
        listen(fd_, 4) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      return;
    }
    address_ = "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
  }
  ~SilentListener() {
    if (fd_ >= 0) close(fd_);
  }
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;

  // host:port, empty when the socket could not be set up.
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

class KvHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefill_ = StartWorker(Options(Role::kPrefill), ServerOptions());
    ASSERT_FALSE(HasFatalFailure());
    decode_ = StartWorker(Options(Role::kDecode), ServerOptions());
    ASSERT_FALSE(HasFatalFailure());
  }
  void TearDown() override {
    if (prefill_ != nullptr) ExpectNothingHeld(*prefill_, "prefill");
    if (decode_ != nullptr) ExpectNothingHeld(*decode_, "decode");
  }

  std::unique_ptr<TestWorker> prefill_;
  std::unique_ptr<TestWorker> decode_;
};

TEST_F(KvHandoffTest, HandleDescribesTheLease) {
  const auto [token, handle] =
      Prefill(*prefill_, "p", Prompt(10, 1), v1::SamplingParams());
  EXPECT_GE(token, 0);
  EXPECT_EQ(handle.source_address(),
            "127.0.0.1:" + std::to_string(prefill_->server->port()));
  EXPECT_EQ(handle.lease_id().size(), 32u);
  EXPECT_EQ(handle.sequence_id(), "p");
  EXPECT_EQ(handle.num_tokens(), 10);
  EXPECT_EQ(handle.model_fingerprint(), prefill_->Status().model_fingerprint());
  EXPECT_EQ(handle.layout().num_layers(), 2);
  EXPECT_EQ(handle.layout().dtype(), "float32");
  // A CPU worker offers only the gRPC stream (CUDA IPC needs GPU memory).
  EXPECT_THAT(handle.transports(), ::testing::ElementsAre("grpc"));
  EXPECT_FALSE(handle.source_host_id().empty());
  const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  EXPECT_GT(handle.lease_expiry_unix_micros(), now_us + 20'000'000);
  EXPECT_LT(handle.lease_expiry_unix_micros(), now_us + 31'000'000);

  // The id is free again on the prefill worker; the blocks are held.
  const v1::WorkerStatus held = prefill_->Status();
  EXPECT_EQ(held.num_sequences(), 0);
  EXPECT_EQ(held.kv_leases(), 1);
  EXPECT_EQ(held.kv_blocks_total() - held.kv_blocks_free(), 3);  // 10 / 4
  Step(*prefill_, Input("p", {1, 2}, true));  // reusing the id is fine
  v1::ReleaseRequest release;
  release.add_sequence_ids("p");
  grpc::ClientContext context;
  v1::ReleaseResponse released;
  ASSERT_TRUE(prefill_->stub->Release(&context, release, &released).ok());

  // A router abandoning the handoff frees the lease.
  v1::KvTransfer::Stub transfer(prefill_->channel);
  grpc::ClientContext rc;
  v1::ReleaseKvRequest rk;
  rk.set_lease_id(handle.lease_id());
  v1::ReleaseKvResponse rr;
  ASSERT_TRUE(transfer.ReleaseKv(&rc, rk, &rr).ok());
  EXPECT_EQ(rr.freed_blocks(), 3);
}

// Greedy and seeded sampling over prompts that end mid-block, on a block
// boundary, span many blocks and need chunking (> 64 tokens per step): the
// P/D tokens equal an aggregated worker's.
TEST_F(KvHandoffTest, TokensMatchAnAggregatedWorker) {
  std::unique_ptr<TestWorker> both =
      StartWorker(Options(Role::kBoth), ServerOptions());
  ASSERT_FALSE(HasFatalFailure());
  int salt = 0;
  for (const int len : {1, 3, 4, 5, 16, 37, 90}) {
    for (const bool greedy : {true, false}) {
      ++salt;
      const std::string id = "s" + std::to_string(salt);
      v1::SamplingParams sampling;
      if (!greedy) {
        sampling.set_temperature(0.8f);
        sampling.set_top_k(20);
        sampling.set_seed(1000 + salt);
      }
      const std::vector<int32_t> prompt = Prompt(len, salt);

      // Aggregated.
      v1::SequenceInput in = Input(id, prompt, true);
      *in.mutable_sampling() = sampling;
      const int32_t first = Step(*both, in).sequences(0).token_id();
      std::vector<int32_t> expected = {first};
      for (int32_t t : Decode(*both, id, first, 6, sampling)) {
        expected.push_back(t);
      }

      // Disaggregated.
      const auto [p_first, handle] = Prefill(*prefill_, id, prompt, sampling);
      v1::ImportKvResponse imported;
      const grpc::Status s = Import(*decode_->stub, id, handle, &imported);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(imported.num_tokens(), len);
      EXPECT_EQ(imported.transport(), "grpc");
      // 2 layers x (K + V) x len tokens x 2 KV heads x 8 dims x 4 bytes.
      EXPECT_EQ(imported.transfer_bytes(), int64_t{2} * 2 * len * 2 * 8 * 4);
      std::vector<int32_t> got = {p_first};
      for (int32_t t : Decode(*decode_, id, p_first, 6, sampling)) {
        got.push_back(t);
      }
      EXPECT_EQ(got, expected)
          << "prompt length " << len << " greedy " << greedy;
    }
  }
  ExpectNothingHeld(*both, "aggregated");
}

TEST_F(KvHandoffTest, NeverPulledLeaseExpiresAndLatePullIsRefused) {
  std::unique_ptr<TestWorker> prefill = StartWorker(
      Options(Role::kPrefill), ServerOptions(std::chrono::milliseconds(300)));
  ASSERT_FALSE(HasFatalFailure());
  const auto [token, handle] =
      Prefill(*prefill, "x", Prompt(9, 3), v1::SamplingParams());
  EXPECT_EQ(prefill->Status().kv_leases(), 1);
  // Freed by the sweeper, without any traffic.
  ExpectNothingHeld(*prefill, "prefill after expiry");
  const grpc::Status late = Import(*decode_->stub, "x", handle);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND)
      << late.error_message();
  EXPECT_THAT(late.error_message(), HasSubstr("expired"));
}

TEST_F(KvHandoffTest, SecondPullIsRefused) {
  const auto [token, handle] =
      Prefill(*prefill_, "a", Prompt(12, 4), v1::SamplingParams());
  ASSERT_TRUE(Import(*decode_->stub, "a", handle).ok());
  // The same handle again (another id; the first is live): refused, and
  // the refused import leaves nothing allocated.
  const grpc::Status again = Import(*decode_->stub, "a2", handle);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << again.error_message();
  EXPECT_THAT(again.error_message(), HasSubstr("already"));
  EXPECT_EQ(decode_->Status().num_sequences(), 1);
  Decode(*decode_, "a", token, 2, v1::SamplingParams());
}

// Someone else (a misbehaving router, a second decode worker) pulled the
// lease in full: the decode worker's import is refused and allocates nothing;
// ReleaseKv then frees the lease. (A pull that is still running, or that
// ended early, is covered by the lease table's unit test.)
TEST_F(KvHandoffTest, ImportOfALeasePulledElsewhereIsRefused) {
  // Not a structured binding: a lambda below captures `handle`.
  const auto prefilled =
      Prefill(*prefill_, "d", Prompt(6, 5), v1::SamplingParams());
  const auto& handle = prefilled.second;
  v1::KvTransfer::Stub transfer(prefill_->channel);
  v1::PullKvRequest request;
  request.set_lease_id(handle.lease_id());
  request.set_model_fingerprint(handle.model_fingerprint());
  *request.mutable_layout() = handle.layout();
  {
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, request);
    v1::KvChunk chunk;
    int64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += chunk.data().size();
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(bytes, 2 * 2 * 6 * 2 * 8 * 4);
  }
  // The source ends the pull (OnDone) a moment after the client saw the
  // stream's end; until then the lease is "being pulled". Both refusals are
  // FAILED_PRECONDITION and allocate nothing.
  grpc::Status s;
  ASSERT_TRUE(WaitFor([&] {
    s = Import(*decode_->stub, "d", handle);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
    return s.error_message().find("already pulled") != std::string::npos;
  })) << s.error_message();
  ExpectNothingHeld(*decode_, "decode after a refused import");
  // Asking a CPU worker for a CUDA IPC export: it offers none.
  {
    v1::PullKvRequest ipc = request;
    ipc.set_transport("cuda_ipc");
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, ipc);
    v1::KvChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  // A PullKv with another model's fingerprint is refused by the source.
  {
    v1::PullKvRequest foreign = request;
    foreign.set_model_fingerprint("0123456789abcdef");
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, foreign);
    v1::KvChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  grpc::ClientContext context;
  v1::ReleaseKvRequest release;
  release.set_lease_id(handle.lease_id());
  v1::ReleaseKvResponse released;
  ASSERT_TRUE(transfer.ReleaseKv(&context, release, &released).ok());
  EXPECT_EQ(released.freed_blocks(), 2);
  grpc::ClientContext again;
  EXPECT_EQ(transfer.ReleaseKv(&again, release, &released).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvHandoffTest, WrongModelOrLayoutIsRefusedWithNothingAllocated) {
  const auto [token, handle] =
      Prefill(*prefill_, "m", Prompt(8, 6), v1::SamplingParams());

  // A decode worker serving another model.
  const std::string other_dir =
      std::string(std::getenv("TEST_TMPDIR")) + "/other_model";
  TinyModelOptions other;
  other.shape = TinyShape::kTied;
  other.seed = 7;
  ASSERT_TRUE(WriteTinyModel(other, other_dir).ok());
  std::unique_ptr<TestWorker> foreign =
      StartWorker(Options(Role::kDecode), ServerOptions(), true, other_dir);
  ASSERT_FALSE(HasFatalFailure());
  grpc::Status s = Import(*foreign->stub, "m", handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model fingerprint"));
  ExpectNothingHeld(*foreign, "foreign decode worker");

  // A tampered layout (same fingerprint) on the right decode worker.
  v1::KvHandle tampered = handle;
  tampered.mutable_layout()->set_dtype("bfloat16");
  s = Import(*decode_->stub, "m", tampered);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("KV layout"));

  // The lease was not consumed: the right worker still imports it.
  ASSERT_TRUE(Import(*decode_->stub, "m", handle).ok());
  Decode(*decode_, "m", token, 1, v1::SamplingParams());
}

// A base checkpoint and its fine-tune: config.json byte for byte the same
// (so the same KV layout), other weights. Their K/V differ, so the handoff
// is refused on the fingerprint, on both sides of the transfer.
TEST_F(KvHandoffTest, SameConfigOtherWeightsIsRefused) {
  const auto [token, handle] =
      Prefill(*prefill_, "w", Prompt(8, 8), v1::SamplingParams());
  const std::string tuned_dir =
      std::string(std::getenv("TEST_TMPDIR")) + "/same_config_other_weights";
  TinyModelOptions tuned;  // the fixture's model but for the seed
  tuned.shape = TinyShape::kGqa;
  tuned.seed = 8;
  ASSERT_TRUE(WriteTinyModel(tuned, tuned_dir).ok());
  std::unique_ptr<TestWorker> tuned_decode =
      StartWorker(Options(Role::kDecode), ServerOptions(), true, tuned_dir);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(tuned_decode->runner.runner->model_config().CanonicalString(),
            prefill_->runner.runner->model_config().CanonicalString());
  ASSERT_EQ(tuned_decode->Status().model_fingerprint().size(), 64u);
  ASSERT_NE(tuned_decode->Status().model_fingerprint(),
            handle.model_fingerprint());

  // The decode side refuses the handle before pulling.
  const grpc::Status s = Import(*tuned_decode->stub, "w", handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model fingerprint"));
  EXPECT_THAT(s.error_message(), HasSubstr(handle.model_fingerprint()));
  ExpectNothingHeld(*tuned_decode, "decode worker with other weights");

  // The source refuses a pull carrying the other weights' fingerprint (a
  // puller that skipped the handle check).
  {
    v1::KvTransfer::Stub transfer(prefill_->channel);
    v1::PullKvRequest pull;
    pull.set_lease_id(handle.lease_id());
    pull.set_model_fingerprint(tuned_decode->Status().model_fingerprint());
    *pull.mutable_layout() = handle.layout();
    grpc::ClientContext context;
    auto reader = transfer.PullKv(&context, pull);
    v1::KvChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status refused = reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("model fingerprint"));
  }

  // The lease survived both refusals: the worker with the same weights
  // imports it and continues the sequence.
  ASSERT_TRUE(Import(*decode_->stub, "w", handle).ok());
  Decode(*decode_, "w", token, 1, v1::SamplingParams());
}

TEST_F(KvHandoffTest, BadImportsAreRefusedWithNothingAllocated) {
  const auto [token, handle] =
      Prefill(*prefill_, "b", Prompt(8, 7), v1::SamplingParams());
  struct Case {
    std::string name;
    std::string id;
    std::function<void(v1::KvHandle*)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"empty id", "", [](v1::KvHandle*) {}, grpc::StatusCode::INVALID_ARGUMENT,
       "sequence_id"},
      {"long id", std::string(129, 'x'), [](v1::KvHandle*) {},
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_id"},
      {"no lease", "b", [](v1::KvHandle* h) { h->clear_lease_id(); },
       grpc::StatusCode::INVALID_ARGUMENT, "lease_id"},
      {"no source", "b", [](v1::KvHandle* h) { h->clear_source_address(); },
       grpc::StatusCode::INVALID_ARGUMENT, "source_address"},
      {"no tokens", "b", [](v1::KvHandle* h) { h->set_num_tokens(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "num_tokens"},
      {"too long", "b", [](v1::KvHandle* h) { h->set_num_tokens(129); },
       grpc::StatusCode::INVALID_ARGUMENT, "max_model_len"},
      {"unknown lease", "b",
       [](v1::KvHandle* h) { h->set_lease_id(std::string(32, '0')); },
       grpc::StatusCode::NOT_FOUND, "unknown KV lease"},
      // The handle disagrees with its lease: the source refuses before
      // sending anything (not INTERNAL: no device fault).
      {"fewer tokens than the lease", "b",
       [](v1::KvHandle* h) { h->set_num_tokens(h->num_tokens() - 1); },
       grpc::StatusCode::FAILED_PRECONDITION, "num_tokens is 7 but lease"},
      {"more tokens than the lease", "b",
       [](v1::KvHandle* h) { h->set_num_tokens(h->num_tokens() + 1); },
       grpc::StatusCode::FAILED_PRECONDITION, "num_tokens is 9 but lease"},
  };
  for (const Case& c : cases) {
    v1::KvHandle h = handle;
    c.mutate(&h);
    const grpc::Status s = Import(*decode_->stub, c.id, h);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
    EXPECT_EQ(decode_->Status().kv_blocks_free(),
              decode_->Status().kv_blocks_total())
        << c.name;
  }

  // A live id on the decode worker: ALREADY_EXISTS before pulling, so the
  // lease survives.
  Step(*decode_, Input("live", {1, 2, 3}, true));
  grpc::Status s = Import(*decode_->stub, "live", handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS)
      << s.error_message();
  ASSERT_TRUE(Import(*decode_->stub, "b", handle).ok());
  Decode(*decode_, "b", token, 1, v1::SamplingParams());
  Decode(*decode_, "live", 5, 1, v1::SamplingParams());
}

// What each role accepts (README, "Roles"): prompts are held for handoff by
// prefill and both workers, KV is imported by decode and both workers. The
// rest is a misrouted call: FAILED_PRECONDITION naming the role, nothing
// allocated, nothing consumed.
TEST_F(KvHandoffTest, EachRoleRefusesTheHandoffSideItDoesNotServe) {
  // A decode worker holds no prompt for handoff.
  v1::SequenceInput hold = Input("h", Prompt(6, 9), true);
  hold.set_hold_for_handoff(true);
  v1::ForwardResponse response;
  grpc::Status s = Forward(*decode_->stub, Request({hold}), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("hold_for_handoff"));
  EXPECT_THAT(s.error_message(), HasSubstr("role is decode"));
  ExpectNothingHeld(*decode_, "decode after a refused hold");

  // A prefill worker imports no KV: not another's, not its own.
  const auto [token, handle] =
      Prefill(*prefill_, "r", Prompt(6, 10), v1::SamplingParams());
  s = Import(*prefill_->stub, "r2", handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("role is prefill"));
  EXPECT_EQ(prefill_->Status().num_sequences(), 0);
  EXPECT_EQ(prefill_->Status().kv_leases(), 1);  // the lease is untouched

  // A worker of role both does either, its own leases included.
  std::unique_ptr<TestWorker> both =
      StartWorker(Options(Role::kBoth), ServerOptions());
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(Import(*both->stub, "r", handle).ok());
  Decode(*both, "r", token, 1, v1::SamplingParams());
  const auto [own_token, own_handle] =
      Prefill(*both, "o", Prompt(5, 11), v1::SamplingParams());
  ASSERT_TRUE(Import(*both->stub, "o2", own_handle).ok());
  Decode(*both, "o2", own_token, 1, v1::SamplingParams());
  ExpectNothingHeld(*both, "both");
}

TEST_F(KvHandoffTest, UnreachableSourceFailsWithUnavailable) {
  const auto [token, handle] =
      Prefill(*prefill_, "u", Prompt(8, 8), v1::SamplingParams());
  v1::KvHandle h = handle;
  // A port nothing listens on (bound and closed by the kernel's choice is
  // racy; port 1 needs root to listen on).
  h.set_source_address("127.0.0.1:1");
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = Import(*decode_->stub, "u", h);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(6));
  // Clean up the real lease.
  ASSERT_TRUE(Import(*decode_->stub, "u", handle).ok());
  Decode(*decode_, "u", token, 1, v1::SamplingParams());
}

// A decode worker told to drain while an import waits on a silent source
// (a socket that accepts connections and never answers): the drain waits
// for the import, which ends with UNAVAILABLE at the pull timeout and frees
// its blocks, instead of cutting the call off.
TEST_F(KvHandoffTest, DecodeDrainWaitsForImportsInFlight) {
  SilentListener silent;
  ASSERT_FALSE(silent.address().empty());
  const auto [token, handle] =
      Prefill(*prefill_, "q", Prompt(8, 10), v1::SamplingParams());
  v1::KvHandle h = handle;
  h.set_source_address(silent.address());

  auto import = std::async(std::launch::async,
                           [&] { return Import(*decode_->stub, "q", h); });
  // In flight means pulling: the engine reserved its blocks. (Counted in
  // kv_imports but still waiting for its reservation, a drain ends it at
  // once instead: kv_import_pressure_test's ADrainEndsTheWaitUnavailable.)
  ASSERT_TRUE(WaitFor([&] {
    const EngineSnapshot e = decode_->server->engine().snapshot();
    return decode_->Status().kv_imports() == 1 && e.waiting_imports == 0 &&
           e.kv.used_blocks > 0;
  }));
  const auto start = std::chrono::steady_clock::now();
  decode_->server->Drain();
  const grpc::Status s = import.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("pull timeout"));
  EXPECT_GE(std::chrono::steady_clock::now() - start,
            std::chrono::milliseconds(500));
  // Drained (no RPCs any more, engine stopped): the runner itself shows
  // the reserved blocks were given back.
  const KvCacheStats kv = decode_->runner.runner->kv_cache().Stats();
  EXPECT_EQ(kv.free_blocks, kv.total_blocks);
  EXPECT_EQ(kv.detached_blocks, 0);
  decode_.reset();

  // The real lease is untouched; give it back.
  v1::KvTransfer::Stub transfer(prefill_->channel);
  grpc::ClientContext context;
  v1::ReleaseKvRequest release;
  release.set_lease_id(handle.lease_id());
  v1::ReleaseKvResponse released;
  ASSERT_TRUE(transfer.ReleaseKv(&context, release, &released).ok());
}

// Rolling restart of a prefill worker: held leases are still served while it
// drains, and the drain waits for them.
TEST_F(KvHandoffTest, DrainingPrefillWorkerStillServesPulls) {
  const auto [token, handle] =
      Prefill(*prefill_, "r", Prompt(20, 9), v1::SamplingParams());
  prefill_->server->BeginDrain();
  ASSERT_TRUE(Import(*decode_->stub, "r", handle).ok());
  ExpectNothingHeld(*prefill_, "draining prefill");
  prefill_->server->Drain();
  Decode(*decode_, "r", token, 3, v1::SamplingParams());
  prefill_.reset();
}

// Lease renewal: an import queued behind a pull that hangs for 4 s (one
// importer thread, the first handle pointing at a silent source) waits
// longer than the source lease's 1.5 s TTL. With renewal (RenewKv within
// 1 s of expiry, every 250 ms) its lease survives and the import
// completes; with renewal off the same wait loses the lease: the import
// fails naming the expiry, and neither worker keeps anything.
TEST(KvLeaseRenewalTest, QueuedImportRenewsItsLeasePastTheTtl) {
  for (const bool renew : {true, false}) {
    SCOPED_TRACE(renew ? "renewal on" : "renewal off");
    std::unique_ptr<TestWorker> prefill =
        StartWorker(Options(Role::kPrefill),
                    ServerOptions(std::chrono::milliseconds(1500)));
    WorkerServerOptions d = ServerOptions();
    d.importer.num_threads = 1;
    d.importer.pull_timeout = std::chrono::milliseconds(4000);
    d.importer.renew_margin = std::chrono::milliseconds(renew ? 1000 : 0);
    std::unique_ptr<TestWorker> decode = StartWorker(Options(Role::kDecode), d);
    SilentListener silent;
    ASSERT_FALSE(silent.address().empty());

    v1::KvHandle stuck =
        Prefill(*prefill, "stuck", Prompt(5, 21), v1::SamplingParams()).second;
    const auto [token, waiting] =
        Prefill(*prefill, "waiting", Prompt(9, 22), v1::SamplingParams());
    stuck.set_source_address(silent.address());
    auto first = std::async(std::launch::async,
                            [&] { return Import(*decode->stub, "x", stuck); });
    ASSERT_TRUE(WaitFor([&] { return decode->Status().kv_imports() == 1; }));
    const auto queued = std::chrono::steady_clock::now();
    const grpc::Status second = Import(*decode->stub, "y", waiting);
    // It waited for the only importer thread: past the lease's TTL.
    EXPECT_GE(std::chrono::steady_clock::now() - queued,
              std::chrono::milliseconds(3000));
    EXPECT_FALSE(first.get().ok());
    if (renew) {
      ASSERT_TRUE(second.ok()) << second.error_message();
      // The imported sequence decodes; its last step releases it.
      Decode(*decode, "y", token, 2, v1::SamplingParams());
    } else {
      EXPECT_EQ(second.error_code(), grpc::StatusCode::NOT_FOUND)
          << second.error_message();
      EXPECT_THAT(second.error_message(), HasSubstr("expired"));
    }
    // Nothing left: the decode worker's reservations were given back, and
    // the source's leases were released (renewal on) or expired.
    EXPECT_TRUE(WaitFor([&] {
      return handoff_testing::HoldsNothing(decode->Status()) &&
             handoff_testing::HoldsNothing(prefill->Status());
    }));
  }
}

// A prefill worker that restarts (on the same address) between a handle's
// issue and its pull: the new process's epoch differs from the handle's,
// so the pull is refused with FAILED_PRECONDITION saying the source
// restarted (not a bare "unknown lease"), nothing stays allocated, and the
// new process's own handles import normally.
TEST(KvSourceEpochTest, RestartedSourceIsDetectedByEpoch) {
  std::unique_ptr<TestWorker> prefill =
      StartWorker(Options(Role::kPrefill), ServerOptions());
  std::unique_ptr<TestWorker> decode =
      StartWorker(Options(Role::kDecode), ServerOptions());
  const v1::KvHandle old_handle =
      Prefill(*prefill, "a", Prompt(7, 31), v1::SamplingParams()).second;
  ASSERT_EQ(old_handle.source_epoch().size(), 32u);
  const int port = prefill->server->port();
  prefill.reset();  // the restart: its leases die with it

  WorkerServerOptions again = ServerOptions();
  again.listen_address = "127.0.0.1:" + std::to_string(port);
  prefill = StartWorker(Options(Role::kPrefill), again);
  ASSERT_EQ(prefill->server->port(), port);
  const auto [token, new_handle] =
      Prefill(*prefill, "b", Prompt(7, 32), v1::SamplingParams());
  EXPECT_EQ(new_handle.source_address(), old_handle.source_address());
  EXPECT_NE(new_handle.source_epoch(), old_handle.source_epoch());

  const grpc::Status stale = Import(*decode->stub, "a", old_handle);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << stale.error_message();
  EXPECT_THAT(stale.error_message(), HasSubstr("restarted"));
  // The status reports the freed reservation once the engine has published
  // it (as everywhere in these tests, waited for).
  EXPECT_TRUE(
      WaitFor([&] { return handoff_testing::HoldsNothing(decode->Status()); }));

  ASSERT_TRUE(Import(*decode->stub, "b", new_handle).ok());
  Decode(*decode, "b", token, 2, v1::SamplingParams());
  EXPECT_TRUE(WaitFor([&] {
    return handoff_testing::HoldsNothing(decode->Status()) &&
           handoff_testing::HoldsNothing(prefill->Status());
  }));
}

}  // namespace
}  // namespace pdworker
