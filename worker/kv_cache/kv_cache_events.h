// KV cache events: what the prefix cache tells cache-aware routers (llm-d's
// KV-cache indexer, Dynamo's KV router, SMG's SubscribeKvEvents) about the
// blocks a worker holds. The same three kinds as vLLM's KV events
// (BlockStored, BlockRemoved, AllBlocksCleared); the wire formats (ZMQ +
// msgpack, gRPC) are the publishers' business.
#ifndef PDWORKER_WORKER_KV_CACHE_KV_CACHE_EVENTS_H_
#define PDWORKER_WORKER_KV_CACHE_KV_CACHE_EVENTS_H_

#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "absl/types/span.h"

namespace pdworker {

// A block hash as routers see it: the first 8 bytes, big-endian, of the
// block's SHA-256 chain digest (see block_hash.h for what the digest
// covers), so a router can recompute it from token ids.
using ExternalBlockHash = uint64_t;

// Consecutive full blocks of one sequence became cached (shareable).
struct BlockStoredEvent {
  std::vector<ExternalBlockHash> block_hashes;  // in sequence order
  // The block before the first one; none when the first one starts the
  // sequence (its parent is the salt's root digest).
  std::optional<ExternalBlockHash> parent_block_hash;
  // block_size tokens per block, blocks in order.
  std::vector<int32_t> token_ids;
  int32_t block_size = 0;
};

// Blocks stopped being cached (evicted, or a rolled-back step's blocks).
struct BlockRemovedEvent {
  std::vector<ExternalBlockHash> block_hashes;
};

// The whole prefix cache was cleared (FlushCache).
struct AllBlocksClearedEvent {};

using KvCacheEvent =
    std::variant<BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent>;

// Where the engine hands each loop iteration's events, as one batch
// (worker/kv_events' KvEventSink: vLLM's ZMQ wire and SMG's gRPC stream).
// An interface so that the engine does not depend on the wire libraries.
class KvEventListener {
 public:
  virtual ~KvEventListener() = default;
  // Called on the engine thread; must not block.
  virtual void Publish(absl::Span<const KvCacheEvent> events) = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_KV_CACHE_EVENTS_H_
