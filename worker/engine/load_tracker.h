// LoadTracker: the two rates GetLoads reports that no counter in the engine
// holds, each over a stated window, with the meaning SMG's vLLM servicer
// gives them (smg-project/smg grpc_servicer/smg_grpc_servicer/vllm/loads.py),
// so a router scores a pdworker like a vLLM worker:
//  - the prefix cache hit rate: cached over prompt tokens of the last
//    kHitRateRequests requests that started (got their first token);
//  - the generation rate: tokens sampled in the last kThroughputWindow,
//    divided by that window (tokens/s).
// The engine thread records; any thread reads. Thread-safe.
#ifndef PDWORKER_WORKER_ENGINE_LOAD_TRACKER_H_
#define PDWORKER_WORKER_ENGINE_LOAD_TRACKER_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/base/thread_annotations.h"

namespace pdworker {

class LoadTracker {
 public:
  using Clock = std::chrono::steady_clock;

  // SMG's HIT_RATE_SAMPLES and THROUGHPUT_WINDOW.
  static constexpr int kHitRateRequests = 64;
  static constexpr std::chrono::milliseconds kThroughputWindow{2000};

  struct Reading {
    double cache_hit_rate = 0.0;  // [0, 1]; 0 before any request started
    double gen_throughput = 0.0;  // tokens/s
  };

  // A request produced its first token: of its `prompt_tokens`,
  // `cached_tokens` came from the prefix cache. A prompt of 0 tokens is
  // not a sample.
  void RecordStart(int32_t prompt_tokens, int32_t cached_tokens);
  // `tokens` were sampled at `at` (calls with the same `at`, one step's,
  // share one entry).
  void RecordGenerated(int64_t tokens, Clock::time_point at);

  Reading Read(Clock::time_point now) const;

 private:
  // Drops samples older than the window before `now`.
  void Trim(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable std::mutex mu_;
  // (prompt tokens, cached tokens), oldest first, and their sums.
  std::deque<std::pair<int32_t, int32_t>> starts_ ABSL_GUARDED_BY(mu_);
  int64_t prompt_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cached_sum_ ABSL_GUARDED_BY(mu_) = 0;
  // (when, tokens sampled), oldest first.
  std::deque<std::pair<Clock::time_point, int64_t>> generated_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_LOAD_TRACKER_H_
