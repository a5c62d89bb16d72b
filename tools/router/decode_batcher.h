// DecodeBatcher: continuous batching of decode steps on one worker.
//
// Requests hand their sequence to the worker's batcher once its first token
// is known (and, for P/D, its KV imported). A thread per worker then runs
// iterations: every active sequence's next step goes into ONE Forward call
// (several calls when more sequences are active than the worker takes per
// call, sent concurrently), so the worker runs them as one batched step and
// reaches its larger CUDA graphs. Sequences join and leave between
// iterations. Tokens go back through each sequence's DecodeStream, so a slow
// consumer never holds up the others' steps.
//
// A failed call changes nothing on the worker, so when a batched call fails
// each of its sequences is retried alone once: only the sequences that are
// really at fault (past max_model_len, evicted by a restart, ...) fail.
// DEADLINE_EXCEEDED and CANCELLED are not retried, so a hung worker fails
// its sequences within one step timeout.
#ifndef PDWORKER_TOOLS_ROUTER_DECODE_BATCHER_H_
#define PDWORKER_TOOLS_ROUTER_DECODE_BATCHER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "proto/worker.grpc.pb.h"
#include "tools/router/worker_pool.h"

namespace pdworker::router {

// One sequence to step until it has generated `tokens_to_generate` tokens or
// sampled `eos_token_id`. The sequence must already be live on the worker
// with every token but `last_token` in its KV cache.
struct DecodeJob {
  std::string sequence_id;
  int32_t last_token = 0;
  int tokens_to_generate = 1;  // >= 1
  std::optional<int32_t> eos_token_id;
  v1::SamplingParams sampling;
};

// The batcher -> request channel of one sequence. Thread-safe.
class DecodeStream {
 public:
  struct Token {
    int32_t id = 0;
    // When the router received the step's response (for inter-token
    // latency; independent of how late the consumer looks).
    std::chrono::steady_clock::time_point arrival;
  };

  // Blocks until the next token (returned) or the end (nullopt; then see
  // status() and released()).
  std::optional<Token> Next();

  // OK, or the error of the step that failed (the sequence is then still
  // live on the worker unless the error says otherwise).
  absl::Status status() const;
  // True when the last step freed the sequence (release_after_step): false
  // after an EOS that came early, or an error, so the caller releases it.
  bool released() const;

 private:
  friend class DecodeBatcher;
  void Push(const Token& token);
  void Finish(absl::Status status, bool released);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Token> tokens_;
  bool finished_ = false;
  absl::Status status_;
  bool released_ = false;
};

struct DecodeBatcherOptions {
  // Sequences per Forward call (the worker's max_num_seqs).
  int max_sequences_per_call = 8;
  // Deadline of one decode Forward call.
  std::chrono::milliseconds step_timeout{60000};
};

struct DecodeBatcherStats {
  int64_t iterations = 0;
  int64_t forward_calls = 0;   // batched calls and solo retries
  int64_t sequence_steps = 0;  // sequences sent, summed over calls
  int64_t solo_retries = 0;    // sequences retried alone after a failure
  int max_sequences_per_call = 0;

  DecodeBatcherStats& operator+=(const DecodeBatcherStats& other);
};

class DecodeBatcher {
 public:
  // `worker` must outlive the batcher. Starts the thread.
  DecodeBatcher(PoolWorker& worker, const DecodeBatcherOptions& options);
  // Stops the thread; sequences still active end with UNAVAILABLE.
  ~DecodeBatcher();

  DecodeBatcher(const DecodeBatcher&) = delete;
  DecodeBatcher& operator=(const DecodeBatcher&) = delete;

  // Adds sequences; they all take part in the same next iteration.
  std::vector<std::shared_ptr<DecodeStream>> Join(std::vector<DecodeJob> jobs);
  std::shared_ptr<DecodeStream> Join(DecodeJob job);

  DecodeBatcherStats stats() const;
  const PoolWorker& worker() const { return worker_; }

 private:
  struct Active {
    DecodeJob job;
    int generated = 0;
    std::shared_ptr<DecodeStream> stream;
  };
  // One sequence's result of an iteration.
  struct Outcome {
    absl::Status status;
    int32_t token = 0;
  };

  void Loop();
  // Steps every sequence in `active` once and drops the finished ones.
  void RunIteration(std::vector<Active>& active);
  // Sends `requests` concurrently; one status (and response) each.
  std::vector<grpc::Status> ForwardAll(
      const std::vector<v1::ForwardRequest>& requests,
      std::vector<v1::ForwardResponse>* responses);

  PoolWorker& worker_;
  const DecodeBatcherOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Active> joining_;  // joined since the last iteration began
  bool stopping_ = false;
  DecodeBatcherStats stats_;
  std::thread thread_;  // last: started once everything else exists
};

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_DECODE_BATCHER_H_
