// The gRPC worker over real loopback gRPC computes what an in-process
// ModelRunner computes: for the same batches, for prompts chunked over
// several steps, and for 64 concurrent clients whose calls are merged into
// batched steps. One bad call in a merged step fails alone, and calls on one
// sequence run in arrival order.
#include <condition_variable>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "worker/server/request_validation.h"

namespace pdworker {
namespace {

using server_testing::Forward;
using server_testing::InProcessRunner;
using server_testing::Input;
using server_testing::MakeRunner;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartForward;
using server_testing::StartWorker;
using server_testing::Steps;
using server_testing::WaitFor;
using ::testing::HasSubstr;

v1::RuntimeMode ProtoMode(RuntimeMode mode) {
  switch (mode) {
    case RuntimeMode::kNone:
      return v1::RUNTIME_MODE_NONE;
    case RuntimeMode::kPiecewise:
      return v1::RUNTIME_MODE_PIECEWISE;
    case RuntimeMode::kFull:
      return v1::RUNTIME_MODE_FULL;
  }
  return v1::RUNTIME_MODE_UNSPECIFIED;
}

std::vector<int32_t> Range(int n, int first) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (first + 37 * i) % 256;
  return tokens;
}

// Runs `request` through the worker and `reference` alike and expects the
// same samples; returns the sampled tokens by sequence id.
std::map<std::string, int32_t> ExpectSameStep(
    server_testing::TestWorker& w, ModelRunner& reference,
    const v1::ForwardRequest& request) {
  std::map<std::string, int32_t> sampled;
  v1::ForwardResponse response;
  const grpc::Status status = Forward(*w.stub, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  auto expected = reference.Execute(Steps(request));
  EXPECT_TRUE(expected.ok()) << expected.status();
  if (!status.ok() || !expected.ok()) return sampled;
  EXPECT_EQ(response.num_steps(), 1);
  EXPECT_EQ(response.step().runtime_mode(), ProtoMode(expected->info.mode));
  EXPECT_EQ(response.step().padded_tokens(), expected->info.padded_tokens);
  EXPECT_EQ(response.step().unpadded_tokens(), expected->info.unpadded_tokens);
  EXPECT_EQ(response.step().num_sequences(), request.sequences_size());
  EXPECT_EQ(response.step().fallback_reason().empty(),
            expected->info.fallback_reason == FallbackReason::kNone);
  EXPECT_EQ(response.sequences_size(), request.sequences_size());
  for (int i = 0; i < response.sequences_size() &&
                  i < static_cast<int>(expected->sequences.size());
       ++i) {
    const v1::SequenceOutput& got = response.sequences(i);
    const SequenceResult& want = expected->sequences[i];
    EXPECT_EQ(got.sequence_id(), request.sequences(i).sequence_id());
    EXPECT_EQ(got.token_id(), want.token_id) << got.sequence_id();
    EXPECT_EQ(got.logprob(), want.logprob) << got.sequence_id();
    EXPECT_EQ(got.num_tokens(), want.num_tokens) << got.sequence_id();
    sampled[got.sequence_id()] = got.token_id();
    if (request.sequences(i).release_after_step()) {
      EXPECT_TRUE(reference.Release(got.sequence_id()).ok());
    }
  }
  return sampled;
}

TEST(WorkerServerTest, SameTokensAsInProcessRunner) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  InProcessRunner reference = MakeRunner(SmallRunnerOptions());
  ModelRunner& ref = *reference.runner;
  std::map<std::string, int32_t> last;
  auto decode = [&](const std::string& id) {
    return Input(id, {last.at(id)}, false);
  };
  auto step = [&](std::vector<v1::SequenceInput> inputs) {
    for (const auto& [id, token] :
         ExpectSameStep(*w, ref, Request(std::move(inputs)))) {
      last[id] = token;
    }
  };

  // Prefill (mixed, padded), decodes (uniform, FULL), prefill + decode,
  // sampling with and without a seed, a prompt above the largest capture
  // size (eager), release_after_step.
  step({Input("a", Range(7, 5), true), Input("b", Range(3, 1), true)});
  step({decode("a"), decode("b")});
  v1::SequenceInput c = Input("c", Range(5, 150), true);
  c.mutable_sampling()->set_temperature(0.8f);
  c.mutable_sampling()->set_top_k(20);
  c.mutable_sampling()->set_top_p(0.9f);
  step({decode("a"), c});
  step({decode("a"), decode("b"), decode("c")});
  v1::SequenceInput d = Input("d", Range(20, 100), true);
  d.mutable_sampling()->set_temperature(1.0f);
  d.mutable_sampling()->set_seed(42);
  step({d});
  v1::SequenceInput b_last = decode("b");
  b_last.set_release_after_step(true);
  step({decode("a"), b_last, decode("c"), decode("d")});
  step({decode("a"), decode("c"), decode("d")});

  const v1::WorkerStatus status = w->Status();
  EXPECT_EQ(status.num_sequences(), 3);
  EXPECT_EQ(status.kv_blocks_free(), ref.kv_cache().Stats().free_blocks);
  EXPECT_EQ(status.kv_blocks_total(), ref.kv_cache().Stats().total_blocks);
  EXPECT_TRUE(status.serving());
  EXPECT_EQ(status.role(), "both");
  EXPECT_EQ(status.configured_mode(), "FULL_AND_PIECEWISE");
  EXPECT_EQ(status.vocab_size(), 256);
  EXPECT_EQ(status.max_num_seqs(), 8);
  EXPECT_EQ(status.max_model_len(), 128);
  EXPECT_EQ(status.kv_block_size(), 4);
  EXPECT_THAT(status.capture_sizes(), ::testing::ElementsAre(1, 2, 4, 8, 16));
  EXPECT_EQ(status.graphs_captured(), ref.NumCapturedGraphs());
  EXPECT_EQ(status.model_fingerprint(), ref.model_fingerprint());
  EXPECT_EQ(status.device(), "cpu");

  // The table the worker exports is the reference's, row for row.
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::GraphStatsResponse stats;
  ASSERT_TRUE(
      w->stub->GetGraphStats(&context, v1::GetGraphStatsRequest(), &stats)
          .ok());
  const std::vector<GraphStatsRow> want = ref.graph_stats().Snapshot();
  ASSERT_EQ(stats.rows_size(), static_cast<int>(want.size()));
  for (int i = 0; i < stats.rows_size(); ++i) {
    EXPECT_EQ(stats.rows(i).unpadded_tokens(), want[i].unpadded_tokens);
    EXPECT_EQ(stats.rows(i).padded_tokens(), want[i].padded_tokens);
    EXPECT_EQ(stats.rows(i).num_paddings(), want[i].num_paddings);
    EXPECT_EQ(stats.rows(i).runtime_mode(), ProtoMode(want[i].mode));
    EXPECT_EQ(stats.rows(i).count(), want[i].count);
  }
  EXPECT_THAT(stats.table(), HasSubstr("| Unpadded Tokens |"));
  EXPECT_THAT(stats.table(), HasSubstr("FULL_AND_PIECEWISE"));
}

TEST(WorkerServerTest, ChunkedPromptsEqualUnchunkedRuns) {
  ModelRunnerOptions small = SmallRunnerOptions();  // 64-token steps
  small.max_model_len = 256;
  auto w = StartWorker(small);
  ASSERT_NE(w, nullptr);
  ModelRunnerOptions big = small;
  big.max_num_batched_tokens = 256;
  InProcessRunner reference = MakeRunner(big);
  ModelRunner& ref = *reference.runner;

  // One sequence of 150 tokens: chunks of 64, 64, 22.
  // Two sequences of 50 and 40: a[0:50] + b[0:14], then b[14:40].
  const std::vector<v1::ForwardRequest> prompts = {
      Request({Input("long", Range(150, 3), true)}),
      Request(
          {Input("p", Range(50, 11), true), Input("q", Range(40, 19), true)}),
  };
  const int expected_steps[] = {3, 2};
  for (int k = 0; k < 2; ++k) {
    const v1::ForwardRequest& prompt = prompts[k];
    v1::ForwardResponse response;
    ASSERT_TRUE(Forward(*w->stub, prompt, &response).ok());
    auto expected = ref.Execute(Steps(prompt));
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(response.num_steps(), expected_steps[k]);
    ASSERT_EQ(response.sequences_size(), prompt.sequences_size());
    for (int i = 0; i < prompt.sequences_size(); ++i) {
      EXPECT_EQ(response.sequences(i).token_id(),
                expected->sequences[i].token_id);
      EXPECT_EQ(response.sequences(i).num_tokens(),
                expected->sequences[i].num_tokens);
    }
    // The step reported is the last chunk's.
    EXPECT_LE(response.step().unpadded_tokens(), 64);
  }

  // Decoding on top of the chunked prefixes matches as well.
  v1::ForwardResponse response;
  for (int round = 0; round < 3; ++round) {
    v1::ForwardRequest decode;
    for (const std::string id : {"long", "p", "q"}) {
      *decode.add_sequences() = Input(id, {(round * 31 + 7) % 256}, false);
    }
    ASSERT_TRUE(Forward(*w->stub, decode, &response).ok());
    auto expected = ref.Execute(Steps(decode));
    ASSERT_TRUE(expected.ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(response.sequences(i).token_id(),
                expected->sequences[i].token_id);
    }
  }
  EXPECT_EQ(w->Status().kv_blocks_free(), ref.kv_cache().Stats().free_blocks);
}

// 64 clients, one sequence each: a prompt and five greedy decode steps.
// The prompt round and two decode rounds are lined up (the engine is
// paused until all 64 calls are queued), so those steps are batched by
// construction; the last three rounds run free. Every client gets what its
// sequence alone gives in-process.
TEST(WorkerServerTest, CoalescesConcurrentClientsWithoutChangingResults) {
  constexpr int kClients = 64, kRounds = 6, kLinedUpRounds = 3;
  ModelRunnerOptions options = SmallRunnerOptions();
  options.max_num_seqs = 64;
  options.max_num_batched_tokens = 256;
  options.max_model_len = 64;
  auto config = ParseCompilationConfig(
      R"({"cudagraph_capture_sizes":[1,2,4,8,16,32,64]})");
  ASSERT_TRUE(config.ok());
  options.compilation = *config;
  auto w = StartWorker(options);
  ASSERT_NE(w, nullptr);

  // Reference: each sequence alone.
  std::vector<std::vector<int32_t>> want(kClients);
  {
    InProcessRunner reference = MakeRunner(options);
    for (int c = 0; c < kClients; ++c) {
      const std::string id = "client-" + std::to_string(c);
      std::vector<int32_t> input = Range(3, c * 5);
      for (int round = 0; round < kRounds; ++round) {
        auto r = reference.runner->Execute(
            Steps(Request({Input(id, input, round == 0)})));
        ASSERT_TRUE(r.ok()) << r.status();
        want[c].push_back(r->sequences[0].token_id);
        input = {r->sequences[0].token_id};
      }
    }
  }

  std::mutex mu;
  std::condition_variable cv;
  int go_round = -1;  // rounds <= go_round may be sent
  int done = 0;
  std::vector<std::vector<int32_t>> got(kClients);
  std::vector<std::vector<int>> step_sequences(kClients);
  std::vector<std::thread> clients;
  clients.reserve(kClients);
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      const std::string id = "client-" + std::to_string(c);
      std::vector<int32_t> input = Range(3, c * 5);
      for (int round = 0; round < kRounds; ++round) {
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return go_round >= round; });
        }
        v1::ForwardResponse response;
        const grpc::Status s = Forward(
            *w->stub, Request({Input(id, input, round == 0)}), &response);
        EXPECT_TRUE(s.ok()) << s.error_message();
        const int32_t token = s.ok() ? response.sequences(0).token_id() : -1;
        input = {token};
        std::lock_guard<std::mutex> lock(mu);
        got[c].push_back(token);
        step_sequences[c].push_back(response.step().num_sequences());
        ++done;
        cv.notify_all();
      }
    });
  }
  for (int round = 0; round < kLinedUpRounds; ++round) {
    w->server->engine().Pause();
    {
      std::lock_guard<std::mutex> lock(mu);
      go_round = round;
    }
    cv.notify_all();
    ASSERT_TRUE(WaitFor([&] {
      return w->server->engine().snapshot().queued_calls == kClients;
    }));
    w->server->engine().Resume();
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == kClients * (round + 1); });
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    go_round = kRounds;
  }
  cv.notify_all();
  for (std::thread& t : clients) t.join();

  for (int c = 0; c < kClients; ++c) {
    EXPECT_EQ(got[c], want[c]) << "client " << c;
    for (int round = 0; round < kLinedUpRounds; ++round) {
      EXPECT_EQ(step_sequences[c][round], kClients) << "client " << c;
    }
  }
  // The table shows the batched steps: the merged prompt step (192 tokens,
  // above the largest capture size: eager) and 64-sequence decode steps
  // replayed from the FULL graph of size 64.
  grpc::ClientContext context;
  server_testing::SetGenerousDeadline(&context);
  v1::GraphStatsResponse stats;
  ASSERT_TRUE(
      w->stub->GetGraphStats(&context, v1::GetGraphStatsRequest(), &stats)
          .ok());
  bool prompt_row = false, decode_row = false;
  int64_t steps = 0;
  for (const v1::GraphStatsRow& row : stats.rows()) {
    steps += row.count();
    prompt_row |= row.unpadded_tokens() == 3 * kClients;
    decode_row |= row.unpadded_tokens() == kClients &&
                  row.padded_tokens() == kClients &&
                  row.runtime_mode() == v1::RUNTIME_MODE_FULL &&
                  row.count() >= kLinedUpRounds - 1;
  }
  EXPECT_TRUE(prompt_row) << stats.table();
  EXPECT_TRUE(decode_row) << stats.table();
  EXPECT_LE(steps, kLinedUpRounds + (kRounds - kLinedUpRounds) * kClients);
}

TEST(WorkerServerTest, FailedMergedStepOnlyFailsTheBadCall) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  Engine& engine = w->server->engine();
  engine.Pause();
  auto good1 =
      StartForward(*w->stub, Request({Input("good1", {1, 2, 3}, true)}));
  auto ghost = StartForward(*w->stub, Request({Input("ghost", {4}, false)}));
  auto good2 = StartForward(*w->stub, Request({Input("good2", {5, 6}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 3; }));
  engine.Resume();

  const grpc::Status ghost_status = ghost->result.get();
  EXPECT_EQ(ghost_status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(ghost_status.error_message(), HasSubstr("ghost"));
  InProcessRunner reference = MakeRunner(SmallRunnerOptions());
  for (auto* call : {good1.get(), good2.get()}) {
    const grpc::Status s = call->result.get();
    ASSERT_TRUE(s.ok()) << s.error_message();
    auto expected = reference.runner->Execute(Steps(call->request));
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(call->response.sequences(0).token_id(),
              expected->sequences[0].token_id);
  }
  EXPECT_EQ(w->Status().num_sequences(), 2);
}

TEST(WorkerServerTest, MergedKvDemandTooBigOnlyFailsWhatDoesNotFit) {
  ModelRunnerOptions options = SmallRunnerOptions();
  options.max_num_batched_tokens = 128;
  options.max_model_len = 64;
  options.kv_cache_bytes = int64_t{40} * 1024;  // 40 blocks of 4 tokens
  auto w = StartWorker(options);
  ASSERT_NE(w, nullptr);
  v1::ForwardResponse response;
  ASSERT_TRUE(Forward(*w->stub, Request({Input("filler", Range(60, 1), true)}),
                      &response)
                  .ok());
  ASSERT_EQ(w->Status().kv_blocks_free(), 25);

  // 10 blocks each; merged they need 30 of the 25 free. Queued one at a
  // time so the queue order is a, b, c.
  Engine& engine = w->server->engine();
  engine.Pause();
  std::vector<std::unique_ptr<server_testing::PendingForward>> calls;
  for (const char* id : {"a", "b", "c"}) {
    calls.push_back(
        StartForward(*w->stub, Request({Input(id, Range(40, id[0]), true)})));
    const int64_t queued = static_cast<int64_t>(calls.size());
    ASSERT_TRUE(
        WaitFor([&] { return engine.snapshot().queued_calls == queued; }));
  }
  auto& a = calls[0];
  auto& b = calls[1];
  auto& c = calls[2];
  engine.Resume();
  EXPECT_TRUE(a->result.get().ok());
  EXPECT_TRUE(b->result.get().ok());
  const grpc::Status c_status = c->result.get();
  EXPECT_EQ(c_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(c_status.error_message(), HasSubstr("KV cache full"));
  const v1::WorkerStatus status = w->Status();
  EXPECT_EQ(status.kv_blocks_free(), 5);
  EXPECT_EQ(status.num_sequences(), 3);
}

TEST(WorkerServerTest, CallsOnOneSequenceRunInArrivalOrder) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  Engine& engine = w->server->engine();
  engine.Pause();
  // Start, release, start again: any reordering fails one of them.
  auto first = StartForward(*w->stub, Request({Input("o", {1, 2}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 1; }));
  grpc::ClientContext release_context;
  server_testing::SetGenerousDeadline(&release_context);
  v1::ReleaseRequest release;
  release.add_sequence_ids("o");
  v1::ReleaseResponse released;
  auto release_done = std::make_shared<std::promise<grpc::Status>>();
  std::future<grpc::Status> release_result = release_done->get_future();
  w->stub->async()->Release(
      &release_context, &release, &released,
      [release_done](const grpc::Status& s) { release_done->set_value(s); });
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 2; }));
  auto again = StartForward(*w->stub, Request({Input("o", {3}, true)}));
  ASSERT_TRUE(WaitFor([&] { return engine.snapshot().queued_calls == 3; }));
  engine.Resume();
  EXPECT_TRUE(first->result.get().ok());
  const grpc::Status release_status = release_result.get();
  EXPECT_TRUE(release_status.ok()) << release_status.error_message();
  EXPECT_EQ(released.freed_blocks(), 1);
  const grpc::Status again_status = again->result.get();
  ASSERT_TRUE(again_status.ok()) << again_status.error_message();
  EXPECT_EQ(again->response.sequences(0).num_tokens(), 1);
}

TEST(WorkerServerTest, ReleaseIsAllOrNothing) {
  auto w = StartWorker(SmallRunnerOptions());
  ASSERT_NE(w, nullptr);
  v1::ForwardResponse response;
  ASSERT_TRUE(
      Forward(*w->stub, Request({Input("live", Range(10, 1), true)}), &response)
          .ok());
  const v1::WorkerStatus before = w->Status();

  auto release = [&](const std::vector<std::string>& ids,
                     v1::ReleaseResponse* out) {
    grpc::ClientContext context;
    server_testing::SetGenerousDeadline(&context);
    v1::ReleaseRequest request;
    for (const std::string& id : ids) request.add_sequence_ids(id);
    return w->stub->Release(&context, request, out);
  };
  v1::ReleaseResponse out;
  EXPECT_EQ(release({"live", "unknown"}, &out).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(release({}, &out).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(release({"live", "live"}, &out).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(release({""}, &out).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const v1::WorkerStatus after_errors = w->Status();
  EXPECT_EQ(after_errors.kv_blocks_free(), before.kv_blocks_free());
  EXPECT_EQ(after_errors.num_sequences(), 1);

  ASSERT_TRUE(release({"live"}, &out).ok());
  EXPECT_EQ(out.freed_blocks(), 3);  // 10 tokens in blocks of 4
  EXPECT_EQ(w->Status().num_sequences(), 0);
  EXPECT_EQ(Forward(*w->stub, Request({Input("live", {1}, false)}), &response)
                .error_code(),
            grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace pdworker
