// KvCacheManager: per-sequence block tables over a BlockPool, with
// all-or-nothing allocation for a whole step, and automatic prefix caching:
// a full block is cached under its chained hash (block_hash.h) as soon as
// its token ids are known, shared by every later sequence that starts with
// the same tokens, and kept after its sequences end until evicted.
#ifndef PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_
#define PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/kv_cache/block_hash.h"
#include "worker/kv_cache/block_pool.h"
#include "worker/kv_cache/kv_cache_events.h"

namespace pdworker {

// What a step may do with a sequence id it has not seen.
enum class SequenceCreation {
  kMustExist,        // unknown id -> NOT_FOUND
  kCreateIfMissing,  // unknown id -> new empty sequence
  kMustBeNew,        // known id -> ALREADY_EXISTS
};

enum class PrefixCaching { kOff, kOn };

// A token id the host does not know yet (sampled by a step in flight).
inline constexpr int32_t kUnknownTokenId = -1;

// One sequence's share of a step: `num_new_tokens` tokens whose K/V the step
// will write after the sequence's current tokens.
struct SequenceAppend {
  absl::string_view sequence_id;
  int32_t num_new_tokens = 0;
  SequenceCreation creation = SequenceCreation::kCreateIfMissing;
  // The new tokens' ids (empty: not given; kUnknownTokenId for one a step
  // in flight samples, see SetTokenId). With prefix caching, a sequence
  // this step creates starts with its longest cached prefix of them (the
  // step then computes only the rest, see StepReservation::Entry), and
  // full blocks of known ids become cached.
  absl::Span<const int32_t> token_ids = {};
  // The last this many new tokens are always computed, never taken from the
  // prefix cache: their logits are the step's output (1: the next token's;
  // 1 + k when the step verifies k draft tokens). In [1, num_new_tokens].
  int32_t computed_tail_tokens = 1;
};

// A block entry of a sequence whose block left every layer's window and went
// back to the pool (KvCacheManager::FreeOutsideWindow); attention never
// reads it (the CPU kernel starts at the window, the CUDA kernels skip ids
// outside the cache).
inline constexpr int32_t kFreedBlock = -1;

// The KV state of one sequence. Token i lives in slot
// blocks[i / block_size] * block_size + i % block_size.
struct SequenceKv {
  std::vector<int32_t> blocks;
  int32_t num_tokens = 0;  // tokens whose K/V is (or is being) cached
  // When a step last appended to it, or an import installed it: what the
  // engine's idle-sequence sweep reads (an abandoned sequence's router
  // stopped stepping it and will never release it).
  std::chrono::steady_clock::time_point last_active{};
  // Prefix caching only (empty when off): the ids of tokens [0, num_tokens)
  // (kUnknownTokenId where not known yet), and the hashes of the leading
  // full blocks whose ids are all known.
  std::vector<int32_t> token_ids;
  std::vector<BlockHash> block_hashes;
};

// Tokens [0, num_tokens) of block `src_block` must be copied into
// `dst_block` (all layers, K and V) before the next step: see Truncate.
struct BlockCopy {
  int32_t src_block = -1;
  int32_t dst_block = -1;
  int32_t num_tokens = 0;
};

// A sequence's longest cached prefix.
struct PrefixHit {
  int32_t num_blocks = 0;
  // Of those, blocks some sequence holds: taking a hit on the others
  // takes them out of the free blocks (they would have been evicted).
  int32_t num_held_blocks = 0;
};

// What Append changed, so a step that fails later can be undone exactly.
struct StepReservation {
  struct Entry {
    std::string sequence_id;
    bool created = false;
    int32_t previous_num_tokens = 0;
    int32_t previous_num_blocks = 0;
    int32_t previous_num_hashes = 0;
    // Tokens of the append a created sequence found cached: the step
    // computes num_new_tokens - cached_tokens of them, from position
    // cached_tokens on.
    int32_t cached_tokens = 0;
  };
  std::vector<Entry> entries;  // in the order of the appends
};

struct KvCacheStats {
  int32_t total_blocks = 0;
  int32_t free_blocks = 0;
  int32_t used_blocks = 0;
  int32_t num_sequences = 0;
  int32_t detached_blocks = 0;  // held by leases and imports (in used_blocks)
  // Tokens of live sequences (their K/V written or being written); the
  // rest of used_blocks' slots are partly filled tail blocks and detached
  // blocks.
  int64_t used_tokens = 0;
  // Prefix caching (zero when off).
  int32_t cached_blocks = 0;  // blocks with a hash, held or free
  int64_t evictions = 0;      // cached blocks reused for other tokens
  int64_t query_tokens = 0;   // tokens of new sequences looked up
  int64_t hit_tokens = 0;     // of those, found cached
};

struct PrefixCacheConfig {
  PrefixCaching mode = PrefixCaching::kOff;
  // Chained into every block hash: the model fingerprint, so a cached block
  // only ever matches K/V computed by the same weights and layout.
  std::string salt;
};

// Not thread-safe: the engine thread owns it; others read snapshots the
// engine publishes.
class KvCacheManager {
 public:
  // `max_model_len` caps every sequence's length (tokens). Prefix caching
  // needs block_size <= kMaxHashedBlockSize.
  KvCacheManager(int32_t num_blocks, int32_t block_size, int32_t max_model_len,
                 PrefixCacheConfig prefix_cache = {});

  // Reserves space for one step. All-or-nothing: on any error nothing
  // changes (no sequence created, no block allocated, no length advanced).
  // Errors: INVALID_ARGUMENT (empty id, num_new_tokens <= 0, id twice in one
  // step, length past max_model_len), NOT_FOUND / ALREADY_EXISTS per
  // `creation`, RESOURCE_EXHAUSTED (not enough free blocks for the step).
  absl::StatusOr<StepReservation> Append(
      absl::Span<const SequenceAppend> appends);
  // Reverts a reservation returned by the latest Append (the step failed):
  // blocks it cached are uncached again.
  void Undo(const StepReservation& reservation);

  // --- prefix caching (no-ops, and no hits, when off) ---
  // Creates the empty sequence `sequence_id` holding the longest cached
  // prefix of `token_ids` (at most (size - 1) / block_size blocks: the last
  // token is always computed) and returns its length in tokens (0: nothing
  // cached). ALREADY_EXISTS / INVALID_ARGUMENT (empty id, too long)
  // change nothing. The engine starts its requests so, before planning
  // their first chunk from the cached length.
  absl::StatusOr<int32_t> StartSequence(absl::string_view sequence_id,
                                        absl::Span<const int32_t> token_ids);
  // The longest cached prefix of a token sequence with these block hashes
  // and `num_tokens` tokens (capped as in StartSequence). No side effects.
  PrefixHit Lookup(absl::Span<const BlockHash> hashes,
                   int32_t num_tokens) const;
  // Fills token `position` of a sequence, whose id was kUnknownTokenId (a
  // step in flight sampled it), and caches the blocks that completes. No-op
  // when the sequence is gone, shorter, or the id was known.
  void SetTokenId(absl::string_view sequence_id, int32_t position,
                  int32_t token_id);
  // Forgets every cached hash (blocks in use stay in use, unshared from now
  // on) and records AllBlocksCleared.
  void ClearPrefixCache();
  // Moves the events recorded since the last call to `out` (appends).
  void TakeEvents(std::vector<KvCacheEvent>* out);
  const BlockHasher& hasher() const { return hasher_; }
  PrefixCaching prefix_caching() const { return prefix_cache_.mode; }

  // Frees a sequence's blocks. NOT_FOUND when unknown.
  absl::Status Free(absl::string_view sequence_id);
  // For a model whose every layer slides over `window` tokens: the blocks
  // of `sequence_id` no query from its current length on can see (every
  // position < num_tokens - window + 1) go back to the pool and their
  // entries become kFreedBlock, as vLLM's sliding-window manager frees
  // them. With prefix caching only hashed blocks are freed, and they stay
  // cached (a later hit takes them back) until evicted. A step of this
  // sequence still queued on the stream may read a block freed here (its
  // queries sit at earlier positions); the block's next owner writes it in
  // stream order, after that step, so it reads the old K/V. Returns how many
  // were freed; NOT_FOUND when unknown, INVALID_ARGUMENT for window <= 0. A
  // sequence with freed blocks can be neither detached (its KV is no longer
  // whole, for a handoff) nor truncated.
  absl::StatusOr<int32_t> FreeOutsideWindow(absl::string_view sequence_id,
                                            int32_t window);

  // Shortens a sequence to its first `num_tokens` tokens and frees the blocks
  // past them (their K/V bytes are simply dead). Undoes earlier steps, which
  // Undo cannot: the engine rolls back a chunked call whose later chunk
  // failed. NOT_FOUND when unknown; INVALID_ARGUMENT unless
  // 0 <= num_tokens <= the current length. Changes nothing on error.
  // A cached block the cut falls inside will be written again: it is
  // uncached, or, when other sequences share it, replaced by a fresh block
  // that `copy` says how to fill (RESOURCE_EXHAUSTED when none is free;
  // FAILED_PRECONDITION when `copy` is null).
  absl::Status Truncate(absl::string_view sequence_id, int32_t num_tokens,
                        std::optional<BlockCopy>* copy = nullptr);

  // --- KV handoff: blocks held outside the id table ---
  // A detached SequenceKv owns pool blocks that no sequence id names: a
  // prefill worker's lease, or a decode worker's import in progress. Its
  // blocks count as used until FreeDetached or Attach.

  // Removes a live sequence from the id table, keeping its blocks.
  // NOT_FOUND when unknown.
  absl::StatusOr<SequenceKv> Detach(absl::string_view sequence_id);
  // Allocates blocks for `num_tokens` tokens under no id (their bytes are
  // garbage until written). INVALID_ARGUMENT unless 0 < num_tokens <=
  // max_model_len (and token_ids, when given, has num_tokens ids);
  // RESOURCE_EXHAUSTED when the pool is short. With prefix caching and
  // `token_ids`, the leading blocks come from the cache where it holds them
  // (capped as in StartSequence): `*cached_tokens` (when not null) says how
  // many tokens they hold, whose bytes are already right; an import pulls
  // only the rest.
  absl::StatusOr<SequenceKv> AllocateDetached(
      int32_t num_tokens, absl::Span<const int32_t> token_ids = {},
      int32_t* cached_tokens = nullptr);
  // Makes detached blocks the live sequence `sequence_id`. ALREADY_EXISTS
  // (nothing changes; the caller still owns `kv`) when the id is live.
  // With prefix caching, `token_ids` (when given: num_tokens of them) are
  // the sequence's tokens, and its full blocks become cached.
  absl::Status Attach(absl::string_view sequence_id, SequenceKv& kv,
                      absl::Span<const int32_t> token_ids = {});
  // Returns detached blocks to the pool and clears `kv`.
  void FreeDetached(SequenceKv& kv);

  // nullptr when unknown.
  const SequenceKv* Find(absl::string_view sequence_id) const;
  // Ids of the live sequences last active before `cutoff`, sorted (detached
  // KV is never listed: leases have their own TTL).
  std::vector<std::string> IdleSince(
      std::chrono::steady_clock::time_point cutoff) const;
  // Cache slot of token `position` of `seq` (position < seq.num_tokens).
  int32_t SlotFor(const SequenceKv& seq, int32_t position) const;

  KvCacheStats Stats() const;
  // Sequences, leases and imports holding `block` (tests).
  int32_t ref_count(int32_t block) const { return pool_.ref_count(block); }
  int32_t block_size() const { return block_size_; }
  int32_t max_model_len() const { return max_model_len_; }
  int32_t max_blocks_per_seq() const {
    return (max_model_len_ + block_size_ - 1) / block_size_;
  }

 private:
  int32_t BlocksFor(int32_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }

  bool caching() const { return prefix_cache_.mode == PrefixCaching::kOn; }
  // pool_.Free of the entries that are not kFreedBlock.
  void FreeHeld(absl::Span<const int32_t> blocks);
  static bool HasFreedBlocks(const SequenceKv& seq);
  // The capped hit for `num_tokens` tokens with these hashes.
  PrefixHit FindPrefix(absl::Span<const BlockHash> hashes,
                       int32_t num_tokens) const;
  // References the cached blocks of `hashes` (all cached: a FindPrefix
  // hit) and appends them to `blocks`.
  void TakePrefix(absl::Span<const BlockHash> hashes,
                  std::vector<int32_t>* blocks);
  // Hashes and caches the sequence's full blocks of known ids not hashed
  // yet, recording one BlockStored for them.
  void CacheFullBlocks(SequenceKv& seq);
  // Records BlockRemoved for `hashes` (none: nothing).
  void RecordRemoved(absl::Span<const BlockHash> hashes);
  // Allocate with evictions recorded.
  void AllocateBlocks(int32_t count, std::vector<int32_t>* out);

  BlockPool pool_;
  int32_t block_size_;
  int32_t max_model_len_;
  PrefixCacheConfig prefix_cache_;
  BlockHasher hasher_;
  std::vector<KvCacheEvent> events_;
  std::vector<BlockHash> evicted_;  // scratch for Allocate
  int64_t query_tokens_ = 0;
  int64_t hit_tokens_ = 0;
  absl::flat_hash_map<std::string, SequenceKv> sequences_;
  int32_t detached_blocks_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_
