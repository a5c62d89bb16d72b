#include "tools/router/worker_pool.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tools/router/grpc_status.h"

namespace pdworker::router {

std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also uses it as the timeout
  // of one connection attempt, and a short one fails every call on a slow
  // (loaded, sanitized, remote) connection before its handshake completes.
  // Its default (20 s) stays; status_timeout bounds the wait per call.
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

// One GetStatus call: it must outlive the call until its callback ran.
struct WorkerPool::StatusCall {
  uint64_t generation = 0;  // Entry::generation when sent
  std::chrono::steady_clock::time_point sent;
  grpc::ClientContext context;
  v1::GetStatusRequest request;
  v1::WorkerStatus response;
};

WorkerPool::WorkerPool(const WorkerPoolOptions& options)
    : state_(std::make_shared<State>()) {
  state_->options = options;
}

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(
    const std::vector<std::string>& addresses,
    const WorkerPoolOptions& options) {
  if (addresses.empty()) {
    return absl::InvalidArgumentError("a worker pool needs an address");
  }
  std::set<std::string> seen;
  std::unique_ptr<WorkerPool> pool(new WorkerPool(options));
  for (const std::string& address : addresses) {
    if (address.empty()) {
      return absl::InvalidArgumentError("empty worker address");
    }
    if (!seen.insert(address).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker address ", address, " given twice"));
    }
    auto worker = std::make_unique<PoolWorker>();
    worker->index = static_cast<int>(pool->workers_.size());
    worker->address = address;
    worker->channel = MakeWorkerChannel(address);
    worker->worker = v1::Worker::NewStub(worker->channel);
    worker->kv_transfer = v1::KvTransfer::NewStub(worker->channel);
    worker->engine = vllm::grpc::engine::VllmEngine::NewStub(worker->channel);
    pool->workers_.push_back(std::move(worker));
    pool->state_->entries.emplace_back();
    pool->state_->entries.back().address = address;
  }
  return pool;
}

WorkerPool::~WorkerPool() {
  State& state = *state_;
  std::unique_lock<std::mutex> lock(state.mu);
  for (Entry& entry : state.entries) {
    // (TryCancel before the call started cancels it when it starts.)
    if (entry.in_flight) entry.call->context.TryCancel();
  }
  state.cv.wait(lock, [&] {
    return std::all_of(state.entries.begin(), state.entries.end(),
                       [](const Entry& e) { return !e.in_flight; });
  });
  // Here, on this thread, while the pool still holds the channels.
  for (Entry& entry : state.entries) entry.call.reset();
}

void WorkerPool::OnStatus(State& state, int index, const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(state.mu);
  Entry& entry = state.entries[index];
  const Clock::time_point now = Clock::now();
  entry.in_flight = false;
  entry.fetched = now;
  // An answer to a call sent before Invalidate is still news, but not the
  // fresh one a waiting pick asked for.
  if (entry.call->generation == entry.generation) entry.fresh_once = true;
  if (entry.call->sent < entry.rechecked) {
    // Recheck's answer is newer; keep it.
  } else if (status.ok()) {
    entry.status = std::move(entry.call->response);
    entry.last_good = now;
    // The fresh figures include (most of) what was placed before.
    entry.placed_sequences = 0;
    entry.placed_blocks = 0;
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
             entry.status.ok() &&
             now - entry.last_good < state.options.slow_status_grace) {
    // Busy, not gone: keep routing on the last answer (and the placements
    // counted on top of it) for a while.
  } else {
    entry.status = FromGrpc(status, "GetStatus", entry.address);
  }
  state.cv.notify_all();
}

void WorkerPool::RefreshStale(std::unique_lock<std::mutex>& lock) {
  State& state = *state_;
  const Clock::time_point now = Clock::now();
  std::vector<std::pair<int, StatusCall*>> started;
  for (int index = 0; index < static_cast<int>(state.entries.size()); ++index) {
    Entry& entry = state.entries[index];
    if (entry.in_flight) continue;
    const auto age = now - entry.fetched;
    const bool stale =
        !entry.fresh_once ||
        (entry.status.ok() ? age >= state.options.status_ttl
                           : age >= state.options.failure_backoff);
    if (!stale) continue;
    // Replaces the previous call, whose callback has run.
    entry.call = std::make_unique<StatusCall>();
    entry.in_flight = true;
    entry.call->generation = entry.generation;
    entry.call->sent = now;
    SetTimeout(&entry.call->context, state.options.status_timeout);
    started.emplace_back(index, entry.call.get());
  }
  if (started.empty()) return;
  // Unlocked: gRPC may run a callback inline (a call that fails at once),
  // and the callback takes the lock.
  lock.unlock();
  for (const auto& [index, call] : started) {
    // `call` stays alive until its callback ran (in_flight); the callback
    // keeps the shared state alive.
    workers_[index]->worker->async()->GetStatus(
        &call->context, &call->request, &call->response,
        [state_ref = state_, index = index](grpc::Status status) {
          OnStatus(*state_ref, index, status);
        });
  }
  lock.lock();
}

void WorkerPool::WaitFreshOnce(std::unique_lock<std::mutex>& lock) {
  State& state = *state_;
  auto all_fresh = [&] {
    return std::all_of(state.entries.begin(), state.entries.end(),
                       [](const Entry& e) { return e.fresh_once; });
  };
  // Bounded: every call ends within status_timeout, and a worker needs at
  // most two (one sent before an Invalidate, then its own).
  while (true) {
    RefreshStale(lock);
    if (all_fresh()) return;
    state.cv.wait(lock);
  }
}

void WorkerPool::Invalidate() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (Entry& entry : state_->entries) {
    entry.fresh_once = false;
    entry.generation += 1;
  }
}

bool WorkerPool::Recheck(int index) {
  State& state = *state_;
  grpc::ClientContext context;
  SetTimeout(&context, state.options.status_timeout);
  v1::WorkerStatus response;
  const grpc::Status status = workers_[index]->worker->GetStatus(
      &context, v1::GetStatusRequest(), &response);
  std::lock_guard<std::mutex> lock(state.mu);
  Entry& entry = state.entries[index];
  const Clock::time_point now = Clock::now();
  entry.fetched = now;
  entry.rechecked = now;
  entry.placed_sequences = 0;
  entry.placed_blocks = 0;
  if (status.ok()) {
    entry.last_good = now;
    entry.status = std::move(response);
    return entry.status->serving();
  }
  entry.status = FromGrpc(status, "GetStatus", entry.address);
  return false;
}

absl::StatusOr<v1::WorkerStatus> WorkerPool::Status(int index) {
  std::unique_lock<std::mutex> lock(state_->mu);
  WaitFreshOnce(lock);
  return state_->entries[index].status;
}

absl::StatusOr<PoolWorker*> WorkerPool::PickLeastLoaded(
    int expected_tokens, absl::Span<const int32_t> preference) {
  State& state = *state_;
  std::unique_lock<std::mutex> lock(state.mu);
  WaitFreshOnce(lock);

  // The index of the best worker, or -1.
  auto choose = [&](std::vector<std::string>* skipped) {
    int best = -1;
    int32_t best_preference = 0;
    int64_t best_free = 0;
    int best_sequences = 0;
    for (int i = 0; i < static_cast<int>(state.entries.size()); ++i) {
      const Entry& entry = state.entries[i];
      if (!entry.status.ok()) {
        skipped->emplace_back(entry.status.status().message());
        continue;
      }
      const v1::WorkerStatus& status = *entry.status;
      if (!status.serving()) {
        skipped->push_back(absl::StrCat(entry.address, ": not serving"));
        continue;
      }
      const int64_t free_blocks =
          int64_t{status.kv_blocks_free()} - entry.placed_blocks;
      const int sequences = status.num_sequences() + entry.placed_sequences;
      const int32_t pref =
          i < static_cast<int>(preference.size()) ? preference[i] : 0;
      if (best < 0 || pref > best_preference ||
          (pref == best_preference &&
           (free_blocks > best_free ||
            (free_blocks == best_free && sequences < best_sequences)))) {
        best = i;
        best_preference = pref;
        best_free = free_blocks;
        best_sequences = sequences;
      }
    }
    return best;
  };

  std::vector<std::string> skipped;
  int best = choose(&skipped);
  if (best < 0) {
    // Nothing usable in the cache: the refreshes in flight (a worker back
    // from a restart, one that finished capturing) may change that.
    state.cv.wait(lock, [&] {
      return std::all_of(state.entries.begin(), state.entries.end(),
                         [](const Entry& e) { return !e.in_flight; });
    });
    skipped.clear();
    best = choose(&skipped);
  }
  if (best < 0) {
    return absl::UnavailableError(
        absl::StrCat("no worker available: ", absl::StrJoin(skipped, "; ")));
  }
  Entry& chosen = state.entries[best];
  const int block_size = std::max(1, chosen.status->kv_block_size());
  const int32_t cached =
      best < static_cast<int>(preference.size()) ? preference[best] : 0;
  chosen.placed_sequences += 1;
  chosen.placed_blocks +=
      (std::max(0, expected_tokens) + block_size - 1) / block_size -
      std::max(0, cached) / block_size;
  return workers_[best].get();
}

}  // namespace pdworker::router
