// KvCacheSpec: how many bytes one KV block costs, and how many blocks a byte
// budget buys.
#ifndef PDWORKER_WORKER_KV_CACHE_KV_CACHE_SPEC_H_
#define PDWORKER_WORKER_KV_CACHE_KV_CACHE_SPEC_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pdworker {

// Shape of the paged KV cache. Each layer has a key and a value cache of
// [num_blocks, block_size, num_kv_heads, head_dim] elements.
struct KvCacheSpec {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;    // tokens per block
  int dtype_bytes = 4;    // 4 = fp32 (CPU), 2 = bf16 (CUDA)
  int max_model_len = 0;  // longest sequence in tokens (context + new)

  // Bytes of one block across all layers, K and V.
  int64_t BytesPerBlock() const;
  // Elements of one block in one layer's K (or V) cache.
  int64_t ElementsPerBlockPerLayer() const;
  // Blocks a sequence of max_model_len tokens needs (block-table width).
  int MaxBlocksPerSeq() const;
  std::string ToString() const;
};

// Validates `spec` and returns how many whole blocks fit in `budget_bytes`.
// INVALID_ARGUMENT for a malformed spec, RESOURCE_EXHAUSTED when the budget
// cannot hold even one maximal-length sequence (naming both numbers, so the
// operator knows how much --kv_cache_bytes to give).
absl::StatusOr<int64_t> NumBlocksForBudget(const KvCacheSpec& spec,
                                           int64_t budget_bytes);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_KV_CACHE_SPEC_H_
