// PrefixIndex: which prompt prefixes each worker holds, learned from the
// workers' vLLM-format KV events (worker/kv_events/README.md), the way
// llm-d's KV-cache indexer learns it.
//
// Per worker, a ZMQ SUB socket on its --kv_events_endpoint and, when given,
// a DEALER on its --kv_events_replay_endpoint. One thread polls them all and
// keeps the set of block hashes each worker holds: BlockStored adds,
// BlockRemoved removes, AllBlocksCleared empties (both event layouts, map
// and array, are read). Batches are applied in sequence order:
//   - on start, and every `resync_interval` while nothing arrives, it asks
//     the replay socket for everything from the next expected sequence on
//     (a late subscriber rebuilds the worker's cache state; a batch the SUB
//     missed while connecting or over a high-water mark is fetched);
//   - a live batch past the next expected one is held back and the gap is
//     replayed; batches the worker no longer keeps are skipped (logged);
//   - a live sequence number below the expected one means the worker
//     restarted: its hashes are dropped and its history replayed from 0.
// Without a replay endpoint, live batches are applied as they come.
//
// Scoring needs the worker's hash chain: its model fingerprint (the salt)
// and KV block size, from its GetStatus (SetModel). A worker whose model is
// unknown, or that runs without prefix caching, scores 0.
#ifndef PDWORKER_TOOLS_ROUTER_PREFIX_INDEX_H_
#define PDWORKER_TOOLS_ROUTER_PREFIX_INDEX_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace zmq {
class context_t;
}  // namespace zmq

namespace pdworker::router {

// Where one worker publishes its KV events.
struct KvEventEndpoints {
  std::string endpoint;         // the worker's PUB (--kv_events_endpoint)
  std::string replay_endpoint;  // its ROUTER (optional)
};

struct PrefixIndexOptions {
  // While a worker sends nothing, ask its replay socket this often whether
  // a batch was missed (an empty answer costs one small message).
  std::chrono::milliseconds resync_interval{1000};
  // A replay that has not ended after this long is asked again.
  std::chrono::milliseconds replay_timeout{5000};
};

// Parses "worker=endpoint,worker=endpoint" (the router's
// --kv_events_endpoints and --kv_events_replay_endpoints flags; worker is
// the host:port the router calls it at) into `*out`, setting `endpoint` or
// `replay_endpoint` of each. INVALID_ARGUMENT for an entry without '=' or a
// worker given twice.
absl::Status ParseKvEventEndpoints(
    const std::string& flag, bool replay,
    std::map<std::string, KvEventEndpoints>* out);

class PrefixIndex {
 public:
  // Keyed by worker address. INVALID_ARGUMENT for a worker without a PUB
  // endpoint; INTERNAL when a socket cannot be set up. Starts the thread.
  static absl::StatusOr<std::unique_ptr<PrefixIndex>> Create(
      const std::map<std::string, KvEventEndpoints>& workers,
      const PrefixIndexOptions& options = {});
  // Stops the thread and closes the sockets.
  ~PrefixIndex();

  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // What the worker's GetStatus said: the hash salt and block size, and
  // whether it caches prefixes at all. Thread-safe; cheap when unchanged.
  void SetModel(const std::string& worker, const std::string& fingerprint,
                int32_t block_size, bool prefix_caching);

  // The tokens of `prompt` the worker would find cached: the longest run of
  // its leading full blocks whose hashes the worker holds, capped at
  // (n - 1) / block_size blocks (the last token is always computed), times
  // the block size. 0 for a worker the index does not know or whose model
  // it has not been told. Thread-safe.
  int32_t LongestPrefixTokens(const std::string& worker,
                              absl::Span<const int32_t> prompt) const;

  // How many block hashes the worker holds, and batches applied so far
  // (for tests and logs). Thread-safe.
  int64_t NumBlocks(const std::string& worker) const;
  int64_t NumBatches(const std::string& worker) const;

 private:
  struct Subscription;

  explicit PrefixIndex(const PrefixIndexOptions& options);
  void Run();
  // Reads what `sub`'s sockets have.
  void DrainLive(Subscription& sub);
  void DrainReplay(Subscription& sub);
  // A batch with sequence `seq` arrived (live or replayed).
  void OnBatch(Subscription& sub, uint64_t seq, std::string payload, bool live);
  // Applies the held-back batches that are next in sequence.
  void ApplyPending(Subscription& sub);
  void Apply(Subscription& sub, const std::string& payload);
  void RequestReplay(Subscription& sub, uint64_t start);

  const PrefixIndexOptions options_;
  std::unique_ptr<zmq::context_t> context_;
  std::vector<std::unique_ptr<Subscription>> subscriptions_;
  std::map<std::string, Subscription*> by_worker_;

  // Guards every Subscription's `model`, `blocks` and `batches`.
  mutable std::mutex mu_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_PREFIX_INDEX_H_
