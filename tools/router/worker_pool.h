// WorkerPool: the workers of one role (prefill, decode or aggregated) and
// least-loaded picking from their GetStatus answers.
//
// Status answers are cached and refreshed in the background: a pick that
// finds a worker's answer older than `status_ttl` (50 ms by default) starts a
// GetStatus for it and picks from the figures it has, so requests do not pay
// a status round trip (only the very first pick waits for the first answers,
// and a pick that finds no usable worker waits for the refreshes in flight).
// Within a cache period the pool counts what it placed itself (sequences and
// the KV blocks they will need) on top of the cached figures, so a burst
// spreads over the workers instead of piling onto the one that looked
// emptiest at the last refresh.
//
// A worker whose GetStatus fails is skipped until `failure_backoff` has
// passed and it answers again, except that a GetStatus that only timed out
// (a busy worker, not a dead or draining one) keeps the last good answer for
// up to `slow_status_grace`.
#ifndef PDWORKER_TOOLS_ROUTER_WORKER_POOL_H_
#define PDWORKER_TOOLS_ROUTER_WORKER_POOL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "proto/worker.grpc.pb.h"

namespace pdworker::router {

struct WorkerPoolOptions {
  // How long a GetStatus answer is used before it is refreshed.
  std::chrono::milliseconds status_ttl{50};
  // A worker whose GetStatus failed is asked again only after this long, so
  // a dead worker is not asked on every pick.
  std::chrono::milliseconds failure_backoff{500};
  // Deadline of one GetStatus call.
  std::chrono::milliseconds status_timeout{2000};
  // How long the last good answer still counts while GetStatus times out.
  std::chrono::milliseconds slow_status_grace{5000};
};

// One worker: its address and the stubs the router calls it through (the
// Worker service and, for the KV handoff, KvTransfer). Stubs are
// thread-safe.
struct PoolWorker {
  int index = 0;  // in its pool
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> worker;
  std::unique_ptr<v1::KvTransfer::Stub> kv_transfer;
  // The request-level API on the same port.
  std::unique_ptr<vllm::grpc::engine::VllmEngine::Stub> engine;
};

// A channel for the router's calls: no message size limit (prompts can be
// long) and reconnect backoff capped at 2 s, so a restarted worker is found
// again within seconds instead of gRPC's default of up to two minutes.
std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& address);

class WorkerPool {
 public:
  // INVALID_ARGUMENT for an empty list, an empty or duplicate address.
  // Connects lazily: an unreachable worker is only skipped when picking.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(
      const std::vector<std::string>& addresses,
      const WorkerPoolOptions& options = {});
  // Cancels the GetStatus calls in flight and waits for them.
  ~WorkerPool();

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }
  PoolWorker& worker(int index) { return *workers_[index]; }

  // The serving worker with the most free KV blocks, then the fewest
  // sequences (both corrected for this pool's own recent placements), then
  // the lowest index. Workers whose GetStatus fails or that are not serving
  // (starting, draining) are skipped; UNAVAILABLE when none is left, with
  // each worker's reason. Records the placement: `expected_tokens` is the KV
  // the request will hold there (prompt, plus generated tokens on a decode
  // worker), counted as whole blocks. Thread-safe.
  //
  // With `preference` (one value per worker: the tokens of the prompt each
  // one has cached), the serving worker with the highest preference wins and
  // the rules above only break ties; the placement then counts only the
  // blocks past the chosen worker's cached prefix (shared, not allocated).
  absl::StatusOr<PoolWorker*> PickLeastLoaded(
      int expected_tokens = 0, absl::Span<const int32_t> preference = {});

  // `index`'s cached status (waiting for the first answer; the error when
  // its GetStatus failed). Thread-safe.
  absl::StatusOr<v1::WorkerStatus> Status(int index);

  // Forgets the cached answers: the next pick (or Status) waits for fresh
  // ones from every worker.
  void Invalidate();

  // Asks `index` for its status now (a blocking GetStatus), caches the
  // answer (or the failure, so picks skip the worker for failure_backoff)
  // and returns whether it serves. For a caller whose call the worker just
  // refused with UNAVAILABLE: draining or gone, or serving after all.
  bool Recheck(int index);

 private:
  using Clock = std::chrono::steady_clock;
  struct StatusCall;
  // What the pool knows about one worker (same index as workers_).
  struct Entry {
    std::string address;
    absl::StatusOr<v1::WorkerStatus> status =
        absl::UnavailableError("not asked yet");
    Clock::time_point fetched;    // of `status` (or of its last failure)
    Clock::time_point last_good;  // when GetStatus last succeeded
    // When Recheck last stored an answer: a background answer to a call
    // sent before then is older news and must not overwrite it.
    Clock::time_point rechecked;
    // False until an answer to a call sent after Create or the last
    // Invalidate arrived: picks wait for it.
    bool fresh_once = false;
    uint64_t generation = 0;  // Invalidate calls so far
    // The last GetStatus (at most one in flight per worker). Kept here, not
    // in its callback, so its ClientContext — which holds a reference to
    // the channel — is destroyed by a router thread: a channel whose last
    // reference goes on a gRPC callback thread makes gRPC try to join that
    // very thread.
    std::unique_ptr<StatusCall> call;
    bool in_flight = false;
    // Placed since `status` was fetched.
    int placed_sequences = 0;
    int64_t placed_blocks = 0;
  };
  // Shared with the GetStatus callbacks, which may finish after the pool's
  // destructor returned; by then it holds no channel (see Entry::call).
  struct State {
    WorkerPoolOptions options;
    std::vector<Entry> entries;  // sized once by Create
    std::mutex mu;               // guards `entries`
    std::condition_variable cv;  // an answer arrived
  };

  explicit WorkerPool(const WorkerPoolOptions& options);

  // Starts a GetStatus for every worker whose answer is stale and that has
  // none in flight. `lock` holds state_->mu; released while starting calls.
  void RefreshStale(std::unique_lock<std::mutex>& lock);
  // Waits until every worker answered a call sent since Create/Invalidate
  // (starting the calls that are needed). `lock` holds state_->mu.
  void WaitFreshOnce(std::unique_lock<std::mutex>& lock);
  static void OnStatus(State& state, int index, const grpc::Status& status);

  std::vector<std::unique_ptr<PoolWorker>> workers_;
  std::shared_ptr<State> state_;
};

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_WORKER_POOL_H_
