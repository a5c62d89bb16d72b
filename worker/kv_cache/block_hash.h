// Block hashes for prefix caching: a full KV block is identified by a
// SHA-256 digest chained from its parent block's digest and its own token
// ids, so equal digests mean equal prefixes (not merely equal blocks).
//
//   root      = SHA-256("pdworker-prefix-cache-v1\0" + salt)
//   digest[i] = SHA-256(digest[i-1] (32 bytes; root for i = 0) ||
//                       token_ids of block i (block_size int32, little-endian))
//
// The salt is the model fingerprint: a block computed by other weights or
// another KV layout never matches. Routers see the first 8 bytes of a
// digest, big-endian (ExternalBlockHash), and can recompute it from token
// ids: hashlib.sha256(parent + struct.pack("<16i", *tokens)).
#ifndef PDWORKER_WORKER_KV_CACHE_BLOCK_HASH_H_
#define PDWORKER_WORKER_KV_CACHE_BLOCK_HASH_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/kv_cache/kv_cache_events.h"

namespace pdworker {

using BlockHash = std::array<uint8_t, 32>;

// Larger blocks than this cannot be hashed (the worker's --block_size is
// far below: 16 by default).
inline constexpr int32_t kMaxHashedBlockSize = 1024;

class BlockHasher {
 public:
  BlockHasher(absl::string_view salt, int32_t block_size);

  // The digest every sequence's first block chains from.
  const BlockHash& root() const { return root_; }
  int32_t block_size() const { return block_size_; }

  // The digest of one full block (`token_ids` holds block_size ids).
  BlockHash Hash(const BlockHash& parent,
                 absl::Span<const int32_t> token_ids) const;
  // Appends the digests of the full blocks of `token_ids` from block
  // `hashes->size()` on (the ones before are taken as already hashed).
  void HashFullBlocks(absl::Span<const int32_t> token_ids,
                      std::vector<BlockHash>* hashes) const;

  static ExternalBlockHash External(const BlockHash& hash);

 private:
  int32_t block_size_;
  BlockHash root_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_BLOCK_HASH_H_
