#include "worker/engine/load_tracker.h"

#include <algorithm>

namespace pdworker {

void LoadTracker::RecordStart(int32_t prompt_tokens, int32_t cached_tokens) {
  if (prompt_tokens <= 0) return;
  cached_tokens = std::clamp(cached_tokens, 0, prompt_tokens);
  std::lock_guard<std::mutex> lock(mu_);
  starts_.emplace_back(prompt_tokens, cached_tokens);
  prompt_sum_ += prompt_tokens;
  cached_sum_ += cached_tokens;
  if (starts_.size() > static_cast<size_t>(kHitRateRequests)) {
    prompt_sum_ -= starts_.front().first;
    cached_sum_ -= starts_.front().second;
    starts_.pop_front();
  }
}

void LoadTracker::RecordGenerated(int64_t tokens, Clock::time_point at) {
  if (tokens <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!generated_.empty() && generated_.back().first == at) {
    generated_.back().second += tokens;  // the same step's
  } else {
    generated_.emplace_back(at, tokens);
  }
  Trim(at);
}

void LoadTracker::Trim(Clock::time_point now) {
  while (!generated_.empty() &&
         now - generated_.front().first > kThroughputWindow) {
    generated_.pop_front();
  }
}

LoadTracker::Reading LoadTracker::Read(Clock::time_point now) const {
  Reading reading;
  std::lock_guard<std::mutex> lock(mu_);
  if (prompt_sum_ > 0) {
    reading.cache_hit_rate =
        static_cast<double>(cached_sum_) / static_cast<double>(prompt_sum_);
  }
  // Newest last: sum back to the window's start. At most one entry per
  // step of the last window, and Trim bounds the rest.
  int64_t tokens = 0;
  for (auto it = generated_.rbegin(); it != generated_.rend(); ++it) {
    if (now - it->first > kThroughputWindow) break;
    tokens += it->second;
  }
  reading.gen_throughput =
      static_cast<double>(tokens) /
      std::chrono::duration<double>(kThroughputWindow).count();
  return reading;
}

}  // namespace pdworker
