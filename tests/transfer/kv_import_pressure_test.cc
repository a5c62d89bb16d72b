// KV imports into a busy decode worker, between in-process workers over
// real gRPC on loopback: an import that finds the KV cache full (or every
// running seat taken, for a P/D decode leg) waits in the engine's queue
// like an admission instead of failing, bounded by --kv_import_wait_timeout,
// the caller's deadline and an unrenewed lease's expiry; a wait that ends,
// is cancelled or turns out to be for a bad handle leaves nothing behind;
// running requests never fail because an import arrived, and decode legs
// never push the running requests past max_num_seqs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "tests/transfer/handoff_test_util.h"
#include "tests/transfer/in_process_handoff.h"

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;

using handoff_testing::Decode;
using handoff_testing::ExpectNothingHeld;
using handoff_testing::Import;
using handoff_testing::Options;
using handoff_testing::Prefill;
using handoff_testing::Prompt;
using handoff_testing::ServerOptions;
using handoff_testing::Step;
using server_testing::Input;
using server_testing::StartWorker;
using server_testing::TestWorker;
using server_testing::WaitFor;
using ::testing::HasSubstr;

using Clock = std::chrono::steady_clock;

// The decode worker's cache: 24 blocks of 4 tokens (max_model_len 64 is 16
// blocks, so one sequence always fits).
constexpr int kDecodeBlocks = 24;
constexpr int kBlockBytes = 1024;  // the tiny model's 4-token block

struct DecodeParams {
  int max_num_seqs = 8;
  int64_t kv_blocks = kDecodeBlocks;
  std::chrono::milliseconds wait_timeout{60000};
  std::chrono::milliseconds renew_margin{5000};
};

std::unique_ptr<TestWorker> StartDecode(const DecodeParams& p) {
  ModelRunnerOptions o = Options(Role::kDecode);
  o.max_model_len = 64;
  o.max_num_seqs = p.max_num_seqs;
  o.kv_cache_bytes = p.kv_blocks * kBlockBytes;
  WorkerServerOptions s = ServerOptions();
  s.model_dir = server_testing::TinyModelDir();
  s.importer.wait_timeout = p.wait_timeout;
  s.importer.renew_margin = p.renew_margin;
  return StartWorker(o, s);
}

std::unique_ptr<TestWorker> StartPrefill(
    std::chrono::milliseconds lease_ttl = std::chrono::milliseconds(30000)) {
  WorkerServerOptions s = ServerOptions(lease_ttl);
  s.model_dir = server_testing::TinyModelDir();
  return StartWorker(Options(Role::kPrefill), s);
}

EngineSnapshot Snapshot(TestWorker& w) { return w.server->engine().snapshot(); }

// One Generate stream on its own thread; Cancel() withdraws it.
class GenerateCall {
 public:
  struct Result {
    grpc::Status status;
    std::vector<int32_t> tokens;
    std::string finish_reason;
    std::string kv_json;  // a prefill leg's kv_transfer_params_json
  };

  GenerateCall(TestWorker& w, vg::GenerateRequest request)
      : stub_(vg::VllmEngine::NewStub(w.channel)) {
    context_.set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(120));
    result_ = std::async(std::launch::async, [this, request] {
      Result r;
      auto reader = stub_->Generate(&context_, request);
      vg::GenerateResponse response;
      while (reader->Read(&response)) {
        if (response.has_chunk()) {
          for (const uint32_t t : response.chunk().token_ids()) {
            r.tokens.push_back(static_cast<int32_t>(t));
          }
        } else if (response.has_complete()) {
          r.finish_reason = response.complete().finish_reason();
          r.kv_json = response.complete().kv_transfer_params_json();
          if (!request.stream()) {
            for (const uint32_t t : response.complete().output_ids()) {
              r.tokens.push_back(static_cast<int32_t>(t));
            }
          }
        }
      }
      r.status = reader->Finish();
      return r;
    });
  }
  ~GenerateCall() {
    if (result_.valid()) result_.wait();
  }

  void Cancel() { context_.TryCancel(); }
  bool done() const {
    return result_.wait_for(std::chrono::seconds(0)) ==
           std::future_status::ready;
  }
  Result Wait() { return result_.get(); }

 private:
  std::unique_ptr<vg::VllmEngine::Stub> stub_;
  grpc::ClientContext context_;
  std::future<Result> result_;
};

vg::GenerateRequest Generation(const std::string& id,
                               const std::vector<int32_t>& prompt,
                               int max_tokens, bool stream = true) {
  vg::GenerateRequest g;
  g.set_request_id(id);
  for (const int32_t t : prompt) g.mutable_tokenized()->add_input_ids(t);
  g.set_stream(stream);
  g.mutable_sampling_params()->set_temperature(0.0f);
  g.mutable_sampling_params()->set_max_tokens(max_tokens);
  g.mutable_sampling_params()->set_ignore_eos(true);
  return g;
}

// A P/D prefill leg on `prefill`: the kv_transfer_params_json for the
// decode leg of `prompt`.
std::string PrefillLeg(TestWorker& prefill, const std::string& id,
                       const std::vector<int32_t>& prompt) {
  GenerateCall call(prefill, Generation(id, prompt, 1, /*stream=*/false));
  GenerateCall::Result r = call.Wait();
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_FALSE(r.kv_json.empty());
  return r.kv_json;
}

vg::GenerateRequest DecodeLeg(const std::string& id,
                              const std::vector<int32_t>& prompt,
                              const std::string& kv_json, int max_tokens) {
  vg::GenerateRequest g = Generation(id, prompt, max_tokens);
  g.set_kv_transfer_params_json(kv_json);
  return g;
}

// An ImportKv on its own thread; Cancel() withdraws it.
class ImportCall {
 public:
  ImportCall(TestWorker& decode, const std::string& id,
             const v1::KvHandle& handle,
             std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::ImportKvRequest request;
    request.set_sequence_id(id);
    *request.mutable_handle() = handle;
    result_ = std::async(std::launch::async, [this, &decode, request] {
      v1::ImportKvResponse response;
      return decode.stub->ImportKv(&context_, request, &response);
    });
  }
  ~ImportCall() {
    if (result_.valid()) result_.wait();
  }

  void Cancel() { context_.TryCancel(); }
  bool done() const {
    return result_.wait_for(std::chrono::seconds(0)) ==
           std::future_status::ready;
  }
  grpc::Status Wait() { return result_.get(); }

 private:
  grpc::ClientContext context_;
  std::future<grpc::Status> result_;
};

// Fills the decode worker's cache with two step-level sequences of 60 and
// 36 tokens (15 + 9 = 24 blocks): no import fits until one is released.
void FillWithSequences(TestWorker& decode) {
  Step(decode, Input("fill60", Prompt(60, 90), true));
  Step(decode, Input("fill36", Prompt(36, 91), true));
  ASSERT_EQ(Snapshot(decode).kv.free_blocks, 0);
}

// After an import that ended while waiting for room in a cache filled by
// FillWithSequences: the decode worker holds what it held `before` (the two
// fill sequences) and no import; the prefill worker still holds the lease.
void ExpectImportReservedNothing(TestWorker& decode, TestWorker& prefill,
                                 const KvCacheStats& before) {
  const EngineSnapshot after = Snapshot(decode);
  EXPECT_EQ(after.kv.used_blocks, before.used_blocks);
  EXPECT_EQ(after.kv.num_sequences, 2);
  EXPECT_EQ(after.waiting_imports, 0);
  EXPECT_EQ(decode.Status().kv_imports(), 0);
  EXPECT_EQ(prefill.server->leases().size(), 1u);
}

void Release(TestWorker& decode, const std::string& id) {
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::ReleaseRequest request;
  request.add_sequence_ids(id);
  v1::ReleaseResponse response;
  const grpc::Status s = decode.stub->Release(&context, request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// Waits until the decode worker's engine shows `n` imports waiting for room
// or `call` ended; true when they wait.
template <typename Call>
bool WaitsForRoom(TestWorker& decode, const Call& call, int64_t n = 1) {
  WaitFor([&] { return call.done() || Snapshot(decode).waiting_imports >= n; });
  return !call.done() && Snapshot(decode).waiting_imports == n;
}

// Starts the generations `make(round)` returns on `decode` and pauses its
// engine while `held` holds for them (e.g. both running and holding blocks).
// On a fast CPU that window is a few steps long and a poll can miss it under
// load: a round whose calls all finish first is waited for and retried with
// new calls (up to 10 rounds), rather than polling 60 s for a state that is
// gone. Empty when every round was missed.
std::vector<std::unique_ptr<GenerateCall>> StartAndPauseWhile(
    TestWorker& decode,
    const std::function<std::vector<std::unique_ptr<GenerateCall>>(int)>& make,
    const std::function<bool(const EngineSnapshot&)>& held) {
  for (int round = 0; round < 10; ++round) {
    std::vector<std::unique_ptr<GenerateCall>> calls = make(round);
    bool paused = false;
    WaitFor([&] {
      if (held(Snapshot(decode))) {
        decode.server->engine().Pause();
        // A step in flight when Pause came may still change the state.
        if (held(Snapshot(decode))) return paused = true;
        decode.server->engine().Resume();
      }
      for (const auto& call : calls) {
        if (!call->done()) return false;
      }
      return true;
    });
    if (paused) return calls;
  }
  return {};
}

// (a) Two requests fill the decode worker's cache (their prompts alone take
// 20 of its 24 blocks, and they grow to 16 blocks each, so they preempt
// each other); a 60-token import (15 blocks) fits only after both finish.
// It waits, then succeeds, and neither request fails or loses a token.
TEST(KvImportPressureTest, ImportWaitsForRunningRequestsAndThenSucceeds) {
  auto prefill = StartPrefill();
  auto decode = StartDecode({});
  ASSERT_TRUE(prefill && decode);
  const std::vector<int32_t> imported = Prompt(60, 7);
  const auto [first, handle] = Prefill(*prefill, "imp", imported, {});
  ASSERT_GE(first, 0);

  // Both admitted and holding blocks; held there while the import arrives.
  std::vector<std::unique_ptr<GenerateCall>> running = StartAndPauseWhile(
      *decode,
      [&](int round) {
        std::vector<std::unique_ptr<GenerateCall>> calls;
        for (int i = 0; i < 2; ++i) {
          calls.push_back(std::make_unique<GenerateCall>(
              *decode, Generation(absl::StrCat("busy", round, "_", i),
                                  Prompt(40, 20 + i), 24)));
        }
        return calls;
      },
      [](const EngineSnapshot& s) {
        return s.running_requests == 2 && s.kv.free_blocks < 15;
      });
  ASSERT_EQ(running.size(), 2u);
  ASSERT_LT(Snapshot(*decode).kv.free_blocks, 15);

  ImportCall import(*decode, "imp", handle);
  const bool waits = WaitsForRoom(*decode, import);
  decode->server->engine().Resume();
  ASSERT_TRUE(waits) << "the import ended at once: "
                     << import.Wait().error_message();

  const grpc::Status status = import.Wait();
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (int i = 0; i < 2; ++i) {
    const GenerateCall::Result r = running[i]->Wait();
    EXPECT_TRUE(r.status.ok()) << i << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens.size(), 24u) << i;
    EXPECT_EQ(r.finish_reason, "length") << i;
  }
  EXPECT_EQ(Snapshot(*decode).waiting_imports, 0);
  // The imported sequence decodes as any other.
  EXPECT_EQ(Decode(*decode, "imp", first, 3, {}).size(), 3u);
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

// (b) The wait's bound: --kv_import_wait_timeout fails the import with
// RESOURCE_EXHAUSTED naming the flag, having reserved nothing and left the
// lease pullable (a retry once there is room succeeds).
TEST(KvImportPressureTest, WaitPastTheTimeoutFailsAndLeavesNothing) {
  auto prefill = StartPrefill();
  DecodeParams p;
  p.wait_timeout = std::chrono::milliseconds(300);
  auto decode = StartDecode(p);
  ASSERT_TRUE(prefill && decode);
  const auto [first, handle] = Prefill(*prefill, "late", Prompt(8, 3), {});
  ASSERT_GE(first, 0);
  FillWithSequences(*decode);
  ASSERT_FALSE(HasFatalFailure());
  const KvCacheStats before = Snapshot(*decode).kv;

  const Clock::time_point start = Clock::now();
  const grpc::Status status = Import(*decode->stub, "late", handle);
  const auto waited = Clock::now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--kv_import_wait_timeout"));
  EXPECT_GE(waited, std::chrono::milliseconds(250));
  ExpectImportReservedNothing(*decode, *prefill, before);

  // The lease was never pulled: with room, the same handle imports.
  Release(*decode, "fill36");
  const grpc::Status retried = Import(*decode->stub, "late", handle);
  ASSERT_TRUE(retried.ok()) << retried.error_message();
  EXPECT_EQ(Decode(*decode, "late", first, 2, {}).size(), 2u);
  Release(*decode, "fill60");
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

// (b) A drain ends the wait: SIGTERM's BeginDrain answers an import still
// waiting for room UNAVAILABLE at once (routers fail over on it), having
// reserved nothing; the prefill worker's lease stays for another decode
// worker to pull.
TEST(KvImportPressureTest, ADrainEndsTheWaitUnavailable) {
  auto prefill = StartPrefill();
  auto decode = StartDecode({});  // a 60 s wait, unless something ends it
  ASSERT_TRUE(prefill && decode);
  const auto [first, handle] = Prefill(*prefill, "drained", Prompt(8, 5), {});
  ASSERT_GE(first, 0);
  FillWithSequences(*decode);
  ASSERT_FALSE(HasFatalFailure());
  const KvCacheStats before = Snapshot(*decode).kv;

  ImportCall import(*decode, "drained", handle);
  ASSERT_TRUE(WaitsForRoom(*decode, import))
      << "the import ended at once: " << import.Wait().error_message();
  const Clock::time_point drain = Clock::now();
  decode->server->BeginDrain();
  const grpc::Status status = import.Wait();
  EXPECT_LT(Clock::now() - drain, std::chrono::seconds(10));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("draining"));
  ExpectImportReservedNothing(*decode, *prefill, before);
  // The draining worker still serves its own sequences to the end.
  Release(*decode, "fill60");
  Release(*decode, "fill36");
  ExpectNothingHeld(*decode, "decode");
}

// (b) The other bound: a lease nobody renews (--kv_lease_renew_margin=0)
// expires at its TTL; the import waiting for room ends NOT_FOUND then,
// rather than waiting for a lease that is gone, and the prefill worker
// frees the lease's blocks.
TEST(KvImportPressureTest, UnrenewedLeaseExpiryEndsTheWait) {
  auto prefill = StartPrefill(std::chrono::milliseconds(600));
  DecodeParams p;
  p.renew_margin = std::chrono::milliseconds(0);
  auto decode = StartDecode(p);
  ASSERT_TRUE(prefill && decode);
  FillWithSequences(*decode);
  ASSERT_FALSE(HasFatalFailure());
  const KvCacheStats before = Snapshot(*decode).kv;
  const auto [first, handle] = Prefill(*prefill, "stale", Prompt(8, 4), {});
  ASSERT_GE(first, 0);

  // At the lease's expiry, well before the 60 s wait timeout.
  const auto expiry = std::chrono::system_clock::time_point(
      std::chrono::microseconds(handle.lease_expiry_unix_micros()));
  const Clock::time_point start = Clock::now();
  const grpc::Status status = Import(*decode->stub, "stale", handle);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("expired while the import"));
  EXPECT_GE(std::chrono::system_clock::now(),
            expiry - std::chrono::milliseconds(50));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20));
  const EngineSnapshot after = Snapshot(*decode);
  EXPECT_EQ(after.kv.used_blocks, before.used_blocks);
  EXPECT_EQ(after.waiting_imports, 0);
  Release(*decode, "fill60");
  Release(*decode, "fill36");
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

// (b) With renewal on, the lease's end still ends the wait: a lease its
// router releases (or that expires) while the import waits for room is
// reported gone by the next RenewKv, and the import ends NOT_FOUND then
// rather than at --kv_import_wait_timeout, having reserved nothing.
TEST(KvImportPressureTest, ALeaseGoneWhileWaitingEndsTheWait) {
  auto prefill = StartPrefill(std::chrono::milliseconds(600));
  DecodeParams p;
  p.renew_margin = std::chrono::milliseconds(500);
  p.wait_timeout = std::chrono::seconds(30);
  auto decode = StartDecode(p);
  ASSERT_TRUE(prefill && decode);
  FillWithSequences(*decode);
  ASSERT_FALSE(HasFatalFailure());
  const KvCacheStats before = Snapshot(*decode).kv;
  const auto [first, handle] = Prefill(*prefill, "dropped", Prompt(8, 8), {});
  ASSERT_GE(first, 0);

  ImportCall import(*decode, "dropped", handle);
  ASSERT_TRUE(WaitsForRoom(*decode, import))
      << "the import ended at once: " << import.Wait().error_message();
  {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::ReleaseKvRequest request;
    request.set_lease_id(handle.lease_id());
    v1::ReleaseKvResponse response;
    const grpc::Status released = v1::KvTransfer::NewStub(prefill->channel)
                                      ->ReleaseKv(&context, request, &response);
    ASSERT_TRUE(released.ok()) << released.error_message();
  }
  const Clock::time_point released_at = Clock::now();
  const grpc::Status status = import.Wait();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND)
      << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("expired or was released"));
  EXPECT_LT(Clock::now() - released_at, std::chrono::seconds(10));
  const EngineSnapshot after = Snapshot(*decode);
  EXPECT_EQ(after.kv.used_blocks, before.used_blocks);
  EXPECT_EQ(after.waiting_imports, 0);
  Release(*decode, "fill60");
  Release(*decode, "fill36");
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

// (c) With max_num_seqs (2) requests running, P/D decode legs wait for a
// running seat: the running requests never exceed the cap, and all of them
// finish with every token.
TEST(KvImportPressureTest, DecodeLegsWaitForARunningSeat) {
  auto prefill = StartPrefill();
  DecodeParams p;
  p.max_num_seqs = 2;
  p.kv_blocks = 256;
  auto decode = StartDecode(p);
  ASSERT_TRUE(prefill && decode);

  std::vector<std::unique_ptr<GenerateCall>> calls = StartAndPauseWhile(
      *decode,
      [&](int round) {
        std::vector<std::unique_ptr<GenerateCall>> started;
        for (int i = 0; i < 2; ++i) {
          started.push_back(std::make_unique<GenerateCall>(
              *decode, Generation(absl::StrCat("local", round, "_", i),
                                  Prompt(8, 40 + i), 40)));
        }
        return started;
      },
      [](const EngineSnapshot& s) { return s.running_requests == 2; });
  ASSERT_EQ(calls.size(), 2u);

  std::vector<std::string> kv_json;
  for (int i = 0; i < 2; ++i) {
    kv_json.push_back(
        PrefillLeg(*prefill, absl::StrCat("leg", i), Prompt(12, 50 + i)));
  }
  for (int i = 0; i < 2; ++i) {
    calls.push_back(std::make_unique<GenerateCall>(
        *decode,
        DecodeLeg(absl::StrCat("leg", i), Prompt(12, 50 + i), kv_json[i], 6)));
  }
  // Both legs wait for a seat (their KV would fit) while the engine holds
  // the two running requests; none joins them.
  WaitFor([&] {
    const EngineSnapshot s = Snapshot(*decode);
    return s.waiting_imports == 2 || s.running_requests > 2;
  });
  const EngineSnapshot held = Snapshot(*decode);
  EXPECT_EQ(held.running_requests, 2);
  EXPECT_EQ(held.waiting_imports, 2);

  std::atomic<bool> sampling{true};
  std::atomic<int64_t> most_running{0};
  std::thread sampler([&] {
    while (sampling.load()) {
      const int64_t n = Snapshot(*decode).running_requests;
      int64_t seen = most_running.load();
      while (n > seen && !most_running.compare_exchange_weak(seen, n)) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  decode->server->engine().Resume();
  for (size_t i = 0; i < calls.size(); ++i) {
    const GenerateCall::Result r = calls[i]->Wait();
    EXPECT_TRUE(r.status.ok()) << i << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens.size(), i < 2 ? 40u : 6u) << i;
    EXPECT_EQ(r.finish_reason, "length") << i;
  }
  sampling.store(false);
  sampler.join();
  EXPECT_LE(most_running.load(), 2);
  EXPECT_EQ(Snapshot(*decode).waiting_imports, 0);
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

// (d) Imports that end while they wait — cancelled by their client (ImportKv
// and a decode leg), past their deadline, or for a live sequence id — and
// one whose lease is unknown (found out only at the pull, once it got
// room) change nothing: no block, seat or sequence stays, their leases
// stay pullable, and an import behind them still succeeds.
TEST(KvImportPressureTest, ImportsEndedWhileWaitingChangeNothing) {
  auto prefill = StartPrefill();
  DecodeParams p;
  p.max_num_seqs = 1;
  auto decode = StartDecode(p);
  ASSERT_TRUE(prefill && decode);
  const auto [first, handle] = Prefill(*prefill, "good", Prompt(8, 5), {});
  ASSERT_GE(first, 0);
  const std::vector<int32_t> leg_prompt = Prompt(12, 6);
  const std::string leg_json = PrefillLeg(*prefill, "leg", leg_prompt);
  FillWithSequences(*decode);
  ASSERT_FALSE(HasFatalFailure());
  const KvCacheStats before = Snapshot(*decode).kv;
  auto settled = [&] {
    return Snapshot(*decode).waiting_imports == 0 &&
           decode->Status().kv_imports() == 0;
  };
  auto unchanged = [&] {
    const EngineSnapshot s = Snapshot(*decode);
    EXPECT_EQ(s.kv.used_blocks, before.used_blocks);
    EXPECT_EQ(s.kv.num_sequences, 2);
    EXPECT_EQ(s.waiting_imports, 0);
    EXPECT_EQ(s.running_requests + s.waiting_requests, 0);
    EXPECT_EQ(decode->Status().kv_imports(), 0);
  };

  {  // ImportKv cancelled by its client.
    ImportCall import(*decode, "good", handle);
    ASSERT_TRUE(WaitsForRoom(*decode, import))
        << "the import ended at once: " << import.Wait().error_message();
    import.Cancel();
    EXPECT_EQ(import.Wait().error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor(settled));
    unchanged();
  }
  {  // A decode leg cancelled by its client.
    GenerateCall leg(*decode, DecodeLeg("leg", leg_prompt, leg_json, 4));
    ASSERT_TRUE(WaitsForRoom(*decode, leg))
        << "the leg ended at once: " << leg.Wait().status.error_message();
    leg.Cancel();
    EXPECT_EQ(leg.Wait().status.error_code(), grpc::StatusCode::CANCELLED);
    ASSERT_TRUE(WaitFor(settled));
    unchanged();
  }
  {  // Past its deadline while waiting.
    ImportCall import(*decode, "good", handle, std::chrono::milliseconds(300));
    EXPECT_EQ(import.Wait().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    ASSERT_TRUE(WaitFor(settled));
    unchanged();
  }
  // A live sequence's id: refused at once, full cache or not.
  EXPECT_EQ(Import(*decode->stub, "fill60", handle).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  unchanged();
  EXPECT_EQ(prefill->server->leases().size(), 2u);

  // An unknown lease waits like any import, gets room when a sequence is
  // released, fails at the pull and gives the room back; the good import
  // and the decode leg queued behind it then succeed.
  v1::KvHandle unknown = handle;
  unknown.set_lease_id("no-such-lease");
  ImportCall bad(*decode, "bad", unknown);
  ASSERT_TRUE(WaitsForRoom(*decode, bad));
  ImportCall good(*decode, "good", handle);
  ASSERT_TRUE(WaitsForRoom(*decode, good, 2));
  Release(*decode, "fill36");
  EXPECT_EQ(bad.Wait().error_code(), grpc::StatusCode::NOT_FOUND);
  const grpc::Status imported = good.Wait();
  ASSERT_TRUE(imported.ok()) << imported.error_message();
  EXPECT_EQ(Decode(*decode, "good", first, 2, {}).size(), 2u);
  GenerateCall leg(*decode, DecodeLeg("leg", leg_prompt, leg_json, 4));
  const GenerateCall::Result r = leg.Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 4u);
  Release(*decode, "fill60");
  ExpectNothingHeld(*decode, "decode");
  ExpectNothingHeld(*prefill, "prefill");
}

}  // namespace
}  // namespace pdworker
