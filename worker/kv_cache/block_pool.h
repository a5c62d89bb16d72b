// BlockPool: the KV cache's blocks, their reference counts, and the prefix
// cache's index of full blocks by hash.
#ifndef PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_
#define PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/kv_cache/block_hash.h"

namespace pdworker {

// Hands out block ids in [0, num_blocks). A block is held (reference count
// >= 1: sequences, leases and imports sharing it) or free. A free block may
// still be cached: it keeps its hash, and its K/V bytes, until evicted;
// Allocate takes never-cached free blocks first, then evicts cached ones,
// least recently freed first. Allocation is all-or-nothing.
// Not thread-safe: owned by the KvCacheManager, which the engine thread
// drives.
class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  // Appends `count` blocks (reference count 1) to `out`, or returns
  // RESOURCE_EXHAUSTED and changes nothing. The hashes of evicted cached
  // blocks are appended to `evicted` (may be null).
  absl::Status Allocate(int32_t count, std::vector<int32_t>* out,
                        std::vector<BlockHash>* evicted = nullptr);
  // Drops one reference to each block. A block that reaches zero becomes
  // free; the blocks of `blocks` that are cached are queued for eviction
  // last one first (a sequence's tail is worth less than its head).
  // CHECK-fails on an id out of range or already free: a double free is a
  // bookkeeping bug that would corrupt two sequences.
  void Free(absl::Span<const int32_t> blocks);
  // One more reference to a block that is held or cached (a prefix hit).
  void Ref(int32_t block);

  // --- prefix cache ---
  // The block cached under `hash`, if any.
  std::optional<int32_t> Lookup(const BlockHash& hash) const;
  // Caches held block `block` under `hash`. False (nothing changes) when
  // another block already has that hash (two sequences computed the same
  // prefix at once: the first stays the shared one) or `block` is cached.
  bool Cache(int32_t block, const BlockHash& hash);
  // Forgets `block`'s hash (it is about to be written again). Returns the
  // hash it had.
  std::optional<BlockHash> Uncache(int32_t block);
  // Forgets every hash; free cached blocks become plain free blocks.
  void UncacheAll();

  int32_t num_blocks() const { return num_blocks_; }
  // Blocks Allocate can hand out: never-cached free plus evictable ones.
  int32_t num_free() const {
    return static_cast<int32_t>(free_.size()) + num_evictable_;
  }
  int32_t num_used() const { return num_blocks_ - num_free(); }
  int32_t num_cached() const { return static_cast<int32_t>(by_hash_.size()); }
  int32_t num_evictable() const { return num_evictable_; }
  int64_t num_evictions() const { return num_evictions_; }
  int32_t ref_count(int32_t block) const { return ref_count_[block]; }
  bool is_cached(int32_t block) const { return hash_[block].has_value(); }

 private:
  void CheckId(int32_t block) const;
  // The eviction queue: a doubly linked list over block ids (-1 ends it).
  void PushEvictable(int32_t block);
  void RemoveEvictable(int32_t block);

  int32_t num_blocks_;
  // Never-cached free blocks. LIFO: recently freed (cache-warm) blocks are
  // reused first.
  std::vector<int32_t> free_;
  std::vector<int32_t> ref_count_;
  std::vector<std::optional<BlockHash>> hash_;
  absl::flat_hash_map<BlockHash, int32_t> by_hash_;
  // Free cached blocks, oldest (next to evict) at head_.
  std::vector<int32_t> prev_, next_;
  int32_t head_ = -1, tail_ = -1;
  int32_t num_evictable_ = 0;
  int64_t num_evictions_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_
