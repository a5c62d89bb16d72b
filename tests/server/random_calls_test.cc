// A randomized, model-based test of the worker over real gRPC on loopback.
//
// kThreads client threads each own a namespace of sequence ids ("t2-s17")
// and keep an exact shadow of their sequences: the tokens in the worker's KV
// cache. Each thread sends a few hundred random calls (new prompts, some long
// enough to be chunked; decode steps; several tokens at once; several
// sequences at once; release_after_step; Release with and without unknown
// ids; calls that break one rule of proto/worker.proto; calls with a 0-4 ms
// deadline or cancelled mid-flight) and checks every answer against the
// shadow:
//  - the status code is what the contract says for the call in the shadow's
//    state (RESOURCE_EXHAUSTED, from a KV cache the threads share, is
//    allowed where the call could run out of blocks);
//  - OK: each num_tokens is the shadow's length plus the tokens sent, and
//    each sampled token and its logprob are, bit for bit, what an in-process
//    ModelRunner computes for the sequence's whole history in one step, so
//    batching, chunking and rollbacks must not change results;
//  - an error changes nothing: the shadow stays, and every later call checks
//    it (ids of sequences a failed call would have created must not exist);
//  - a call that ended DEADLINE_EXCEEDED or CANCELLED ran whole or not at
//    all: a probe per sequence (a one-token step, or a Release) finds every
//    sequence of the call in the same one of those two states.
// At the end every sequence is released, the worker has all its KV blocks
// free and no sequence, and it still serves.
//
// A failure prints the seed and the thread's last calls. The seed fixes
// each thread's calls; how the threads interleave (and so which calls merge
// or hit a deadline) varies from run to run. Another seed:
//   bazel test //tests/server:random_calls_test --test_env=RANDOM_CALLS_SEED=N
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/random_calls_client.h"
#include "tests/server/server_test_util.h"

namespace pdworker {
namespace {

using random_calls::ClientThread;
using random_calls::Counters;
using random_calls::kBlockSize;
using random_calls::kCallsPerThread;
using random_calls::kMaxModelLen;
using random_calls::kMaxNumSeqs;
using random_calls::kStepTokens;
using random_calls::kVocab;
using random_calls::Oracle;
using random_calls::Sampling;
using server_testing::Input;
using server_testing::Request;
using server_testing::SmallRunnerOptions;
using server_testing::StartWorker;
using server_testing::WaitFor;

constexpr uint32_t kDefaultSeed = 20240611;
constexpr int kThreads = 4;
// Small enough that the threads together sometimes fill it.
constexpr int kKvBlocks = 256;

uint32_t BaseSeed() {
  const char* env = std::getenv("RANDOM_CALLS_SEED");
  return env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10))
                        : kDefaultSeed;
}

TEST(RandomCallsTest, ShadowModelAgreesWithWorker) {
  const uint32_t seed = BaseSeed();
  std::cout << "RANDOM_CALLS_SEED=" << seed << "\n";
  ModelRunnerOptions options = SmallRunnerOptions();
  options.kv_cache_bytes = int64_t{kKvBlocks} * 1024;  // 1 KiB per block
  auto w = StartWorker(options);
  ASSERT_NE(w, nullptr);
  {
    const v1::WorkerStatus status = w->Status();
    ASSERT_EQ(status.kv_blocks_total(), kKvBlocks);
    ASSERT_EQ(status.kv_block_size(), kBlockSize);
    ASSERT_EQ(status.max_num_seqs(), kMaxNumSeqs);
    ASSERT_EQ(status.max_num_batched_tokens(), kStepTokens);
    ASSERT_EQ(status.max_model_len(), kMaxModelLen);
    ASSERT_EQ(status.vocab_size(), kVocab);
  }
  Oracle oracle;
  Counters counters;
  std::vector<std::unique_ptr<ClientThread>> clients;
  for (int t = 0; t < kThreads; ++t) {
    clients.push_back(std::make_unique<ClientThread>(t, seed + t, *w->stub,
                                                     oracle, counters));
  }
  std::vector<std::thread> threads;
  for (auto& client : clients) {
    threads.emplace_back([&client] { client->Run(); });
  }
  for (std::thread& t : threads) t.join();

  const EngineSnapshot snapshot = w->server->engine().snapshot();
  std::cout << "ok " << counters.ok << " (chunked " << counters.chunked_ok
            << "), released " << counters.released << ", INVALID_ARGUMENT "
            << counters.invalid_argument << ", NOT_FOUND " << counters.not_found
            << ", ALREADY_EXISTS " << counters.already_exists
            << ", RESOURCE_EXHAUSTED " << counters.resource_exhausted
            << "; cut short by deadline/cancel: not run "
            << counters.ambiguous_not_run << ", ran " << counters.ambiguous_ran
            << ", undecidable " << counters.ambiguous_unknown
            << "; worker dropped " << snapshot.dropped_deadline
            << " (deadline) + " << snapshot.dropped_cancelled
            << " (cancelled); " << snapshot.steps << " steps; "
            << oracle.computed() << " reference samples\n";
  if (HasFailure()) return;

  // The random mix reached every kind of answer (typical counts are 4 to 10
  // times these).
  constexpr int64_t kCalls = kThreads * kCallsPerThread;
  EXPECT_GT(counters.ok.load(), kCalls / 10);
  EXPECT_GT(counters.chunked_ok.load(), kCalls / 100);
  EXPECT_GT(counters.released.load(), kCalls / 100);
  EXPECT_GT(counters.invalid_argument.load(), kCalls / 100);
  EXPECT_GT(counters.not_found.load(), kCalls / 100);
  EXPECT_GT(counters.already_exists.load(), 0);

  // Calls the clients gave up on are finished on the worker too (the probes
  // that followed them already ran, so this is only a formality).
  ASSERT_TRUE(WaitFor(
      [&] { return w->server->engine().snapshot().queued_calls == 0; }));
  v1::WorkerStatus status = w->Status();
  EXPECT_EQ(status.num_sequences(), 0);
  EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total());

  // And the worker still serves, with the same results.
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 10, 11};
  v1::SequenceInput in = Input("after", prompt, true);
  in.set_release_after_step(true);
  v1::ForwardResponse response;
  const grpc::Status last =
      server_testing::Forward(*w->stub, Request({in}), &response);
  ASSERT_TRUE(last.ok()) << last.error_message();
  EXPECT_EQ(response.sequences(0).num_tokens(), 7);
  EXPECT_EQ(response.sequences(0).token_id(),
            oracle.Next(prompt, Sampling()).token_id);
  status = w->Status();
  EXPECT_EQ(status.num_sequences(), 0);
  EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total());
}

}  // namespace
}  // namespace pdworker
