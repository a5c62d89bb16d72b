// BlockPool: the free list of KV cache block ids.
#ifndef PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_
#define PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace pdworker {

// Hands out block ids in [0, num_blocks). Allocation is all-or-nothing.
// Not thread-safe: owned by the KvCacheManager, which the engine thread
// drives.
class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  // Appends `count` free block ids to `out`, or returns RESOURCE_EXHAUSTED
  // and changes nothing.
  absl::Status Allocate(int32_t count, std::vector<int32_t>* out);
  // Returns blocks to the pool. CHECK-fails on an id out of range or already
  // free: a double free is a bookkeeping bug that would corrupt two sequences.
  void Free(absl::Span<const int32_t> blocks);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks_ - num_free(); }

 private:
  int32_t num_blocks_;
  // LIFO: recently freed (cache-warm) blocks are reused first.
  std::vector<int32_t> free_;
  std::vector<bool> is_free_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_BLOCK_POOL_H_
