// The client side of random_calls_test: client threads that send random
// calls to a worker over gRPC and check every answer against an exact shadow
// of their sequences, and the in-process reference (Oracle) that their
// sampled tokens must equal bit for bit. See random_calls_test.cc.
#ifndef PDWORKER_TESTS_SERVER_RANDOM_CALLS_CLIENT_H_
#define PDWORKER_TESTS_SERVER_RANDOM_CALLS_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "proto/worker.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "worker/runner/model_runner.h"

namespace pdworker::random_calls {

// Under TSan the model runs ~15 times slower: fewer calls keep the test
// well inside its timeout (--config=tsan).
#if defined(__SANITIZE_THREAD__)
constexpr int kCallsPerThread = 120;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr int kCallsPerThread = 120;
#else
constexpr int kCallsPerThread = 400;
#endif
#else
constexpr int kCallsPerThread = 400;
#endif
// SmallRunnerOptions' limits, which the shadow's expectations mirror.
constexpr int kVocab = 256;
constexpr int kMaxModelLen = 128;
constexpr int kMaxNumSeqs = 8;
constexpr int kStepTokens = 64;  // max_num_batched_tokens
constexpr int kBlockSize = 4;

// How a sequence samples. Greedy unless temperature > 0 (then seeded, so the
// draw is a function of the history too).
struct Sampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;

  static Sampling Of(const v1::SequenceInput& in);
  void SetOn(v1::SequenceInput* in) const;
  std::tuple<float, int32_t, uint64_t> Key() const;
};

// The next token of a history, as an in-process ModelRunner computes it in
// one unchunked step of a batch of one. Cached: a history is computed once.
class Oracle {
 public:
  Oracle();

  SequenceResult Next(const std::vector<int32_t>& history, const Sampling& s);
  int64_t computed();

 private:
  std::mutex mu_;
  server_testing::InProcessRunner reference_;
  std::map<
      std::pair<std::vector<int32_t>, std::tuple<float, int32_t, uint64_t>>,
      SequenceResult>
      cache_;
  int64_t computed_ = 0;
};

// Outcome counts over all threads, printed at the end (and a few asserted:
// the random mix must really reach every kind of answer).
struct Counters {
  std::atomic<int64_t> ok{0}, chunked_ok{0}, released{0};
  std::atomic<int64_t> invalid_argument{0}, not_found{0}, already_exists{0},
      resource_exhausted{0};
  std::atomic<int64_t> ambiguous_not_run{0}, ambiguous_ran{0},
      ambiguous_unknown{0};
};

// One client: kCallsPerThread random calls on its own sequence ids
// ("t<index>-s<n>"), each answer checked against its shadow; then it
// releases everything. A mismatch is an ADD_FAILURE with the seed and the
// last calls, and ends the thread's calls.
class ClientThread {
 public:
  ClientThread(int index, uint32_t seed, v1::Worker::Stub& stub, Oracle& oracle,
               Counters& counters);
  ~ClientThread();

  void Run();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdworker::random_calls

#endif  // PDWORKER_TESTS_SERVER_RANDOM_CALLS_CLIENT_H_
