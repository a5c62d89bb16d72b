#include "tools/router/decode_batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tools/router/grpc_status.h"

namespace pdworker::router {

std::optional<DecodeStream::Token> DecodeStream::Next() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !tokens_.empty() || finished_; });
  if (tokens_.empty()) return std::nullopt;
  Token token = tokens_.front();
  tokens_.pop_front();
  return token;
}

absl::Status DecodeStream::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

bool DecodeStream::released() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_;
}

void DecodeStream::Push(const Token& token) {
  std::lock_guard<std::mutex> lock(mu_);
  tokens_.push_back(token);
  cv_.notify_all();
}

void DecodeStream::Finish(absl::Status status, bool released) {
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  status_ = std::move(status);
  released_ = released;
  cv_.notify_all();
}

DecodeBatcherStats& DecodeBatcherStats::operator+=(
    const DecodeBatcherStats& other) {
  iterations += other.iterations;
  forward_calls += other.forward_calls;
  sequence_steps += other.sequence_steps;
  solo_retries += other.solo_retries;
  max_sequences_per_call =
      std::max(max_sequences_per_call, other.max_sequences_per_call);
  return *this;
}

DecodeBatcher::DecodeBatcher(PoolWorker& worker,
                             const DecodeBatcherOptions& options)
    : worker_(worker), options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

DecodeBatcher::~DecodeBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

std::vector<std::shared_ptr<DecodeStream>> DecodeBatcher::Join(
    std::vector<DecodeJob> jobs) {
  std::vector<std::shared_ptr<DecodeStream>> streams;
  std::lock_guard<std::mutex> lock(mu_);
  for (DecodeJob& job : jobs) {
    auto stream = std::make_shared<DecodeStream>();
    streams.push_back(stream);
    if (stopping_) {
      stream->Finish(absl::UnavailableError("the router is shutting down"),
                     false);
      continue;
    }
    joining_.push_back(Active{std::move(job), 0, std::move(stream)});
  }
  cv_.notify_all();
  return streams;
}

std::shared_ptr<DecodeStream> DecodeBatcher::Join(DecodeJob job) {
  std::vector<DecodeJob> jobs;
  jobs.push_back(std::move(job));
  return Join(std::move(jobs)).front();
}

DecodeBatcherStats DecodeBatcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void DecodeBatcher::Loop() {
  // Only this thread touches `active`.
  std::vector<Active> active;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stopping_ || !active.empty() || !joining_.empty();
      });
      for (Active& a : joining_) active.push_back(std::move(a));
      joining_.clear();
      if (stopping_) break;
    }
    RunIteration(active);
  }
  for (Active& a : active) {
    a.stream->Finish(absl::UnavailableError("the router is shutting down"),
                     false);
  }
}

std::vector<grpc::Status> DecodeBatcher::ForwardAll(
    const std::vector<v1::ForwardRequest>& requests,
    std::vector<v1::ForwardResponse>* responses) {
  const size_t n = requests.size();
  responses->assign(n, v1::ForwardResponse());
  std::vector<grpc::Status> statuses(n);
  std::vector<grpc::ClientContext> contexts(n);
  // Shared with the callbacks: the last one may still be unlocking when this
  // thread wakes up and returns.
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;
  };
  auto latch = std::make_shared<Latch>();
  for (size_t i = 0; i < n; ++i) {
    SetTimeout(&contexts[i], options_.step_timeout);
    worker_.worker->async()->Forward(
        &contexts[i], &requests[i], &(*responses)[i],
        [latch, &statuses, i](grpc::Status status) {
          std::lock_guard<std::mutex> lock(latch->mu);
          statuses[i] = std::move(status);
          ++latch->done;
          latch->cv.notify_all();
        });
  }
  std::unique_lock<std::mutex> lock(latch->mu);
  latch->cv.wait(lock, [&] { return latch->done == n; });
  return statuses;
}

void DecodeBatcher::RunIteration(std::vector<Active>& active) {
  const int per_call = std::max(1, options_.max_sequences_per_call);
  auto input_for = [](const Active& a) {
    v1::SequenceInput input;
    input.set_sequence_id(a.job.sequence_id);
    input.add_token_ids(a.job.last_token);
    input.set_start(false);
    *input.mutable_sampling() = a.job.sampling;
    // The step that produces the last token frees the KV with it, saving a
    // Release round trip per request.
    input.set_release_after_step(a.generated + 1 == a.job.tokens_to_generate);
    return input;
  };

  // Batched calls: sequences [first[c], first[c] + size[c]) of `active`.
  std::vector<v1::ForwardRequest> requests;
  std::vector<size_t> first;
  for (size_t i = 0; i < active.size(); i += per_call) {
    first.push_back(i);
    requests.emplace_back();
    const size_t end = std::min(active.size(), i + per_call);
    for (size_t j = i; j < end; ++j) {
      *requests.back().add_sequences() = input_for(active[j]);
    }
  }
  std::vector<v1::ForwardResponse> responses;
  const std::vector<grpc::Status> statuses = ForwardAll(requests, &responses);

  std::vector<Outcome> outcomes(active.size());
  std::vector<size_t> retry;  // indices into `active`
  int largest_call = 0;
  for (size_t c = 0; c < requests.size(); ++c) {
    const int size = requests[c].sequences_size();
    largest_call = std::max(largest_call, size);
    const grpc::Status& status = statuses[c];
    if (status.ok() && responses[c].sequences_size() != size) {
      for (int k = 0; k < size; ++k) {
        outcomes[first[c] + k].status = absl::InternalError(absl::StrCat(
            "decode Forward on ", worker_.address, " answered ",
            responses[c].sequences_size(), " sequences for ", size));
      }
      continue;
    }
    const bool retry_alone =
        !status.ok() && size > 1 &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        status.error_code() != grpc::StatusCode::CANCELLED;
    for (int k = 0; k < size; ++k) {
      const size_t index = first[c] + k;
      if (status.ok()) {
        outcomes[index].token = responses[c].sequences(k).token_id();
      } else if (retry_alone) {
        retry.push_back(index);
      } else {
        outcomes[index].status =
            FromGrpc(status, "decode Forward", worker_.address);
      }
    }
  }

  if (!retry.empty()) {
    std::vector<v1::ForwardRequest> solo(retry.size());
    for (size_t r = 0; r < retry.size(); ++r) {
      *solo[r].add_sequences() = input_for(active[retry[r]]);
    }
    std::vector<v1::ForwardResponse> solo_responses;
    const std::vector<grpc::Status> solo_statuses =
        ForwardAll(solo, &solo_responses);
    for (size_t r = 0; r < retry.size(); ++r) {
      Outcome& outcome = outcomes[retry[r]];
      if (!solo_statuses[r].ok()) {
        outcome.status =
            FromGrpc(solo_statuses[r], "decode Forward", worker_.address);
      } else if (solo_responses[r].sequences_size() != 1) {
        outcome.status = absl::InternalError(
            absl::StrCat("decode Forward on ", worker_.address,
                         " answered a wrong number of sequences"));
      } else {
        outcome.token = solo_responses[r].sequences(0).token_id();
      }
    }
  }

  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.iterations += 1;
    stats_.forward_calls +=
        static_cast<int64_t>(requests.size() + retry.size());
    stats_.sequence_steps += static_cast<int64_t>(active.size() + retry.size());
    stats_.solo_retries += static_cast<int64_t>(retry.size());
    stats_.max_sequences_per_call =
        std::max(stats_.max_sequences_per_call, largest_call);
  }

  const auto arrival = std::chrono::steady_clock::now();
  std::vector<Active> still_active;
  still_active.reserve(active.size());
  for (size_t i = 0; i < active.size(); ++i) {
    Active& a = active[i];
    const Outcome& outcome = outcomes[i];
    if (!outcome.status.ok()) {
      a.stream->Finish(outcome.status, false);
      continue;
    }
    const bool released = a.generated + 1 == a.job.tokens_to_generate;
    a.generated += 1;
    a.job.last_token = outcome.token;
    a.stream->Push(DecodeStream::Token{outcome.token, arrival});
    const bool eos =
        a.job.eos_token_id.has_value() && outcome.token == *a.job.eos_token_id;
    if (released || eos) {
      a.stream->Finish(absl::OkStatus(), released);
      continue;
    }
    still_active.push_back(std::move(a));
  }
  active = std::move(still_active);
}

}  // namespace pdworker::router
