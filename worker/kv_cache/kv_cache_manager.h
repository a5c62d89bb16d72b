// KvCacheManager: per-sequence block tables over a BlockPool, with
// all-or-nothing allocation for a whole step.
#ifndef PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_
#define PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/kv_cache/block_pool.h"

namespace pdworker {

// What a step may do with a sequence id it has not seen.
enum class SequenceCreation {
  kMustExist,        // unknown id -> NOT_FOUND
  kCreateIfMissing,  // unknown id -> new empty sequence
  kMustBeNew,        // known id -> ALREADY_EXISTS
};

// One sequence's share of a step: `num_new_tokens` tokens whose K/V the step
// will write after the sequence's current tokens.
struct SequenceAppend {
  absl::string_view sequence_id;
  int32_t num_new_tokens = 0;
  SequenceCreation creation = SequenceCreation::kCreateIfMissing;
};

// The KV state of one sequence. Token i lives in slot
// blocks[i / block_size] * block_size + i % block_size.
struct SequenceKv {
  std::vector<int32_t> blocks;
  int32_t num_tokens = 0;  // tokens whose K/V is (or is being) cached
  // When a step last appended to it, or an import installed it: what the
  // engine's idle-sequence sweep reads (an abandoned sequence's router
  // stopped stepping it and will never release it).
  std::chrono::steady_clock::time_point last_active{};
};

// What Append changed, so a step that fails later can be undone exactly.
struct StepReservation {
  struct Entry {
    std::string sequence_id;
    bool created = false;
    int32_t previous_num_tokens = 0;
    int32_t previous_num_blocks = 0;
  };
  std::vector<Entry> entries;
};

struct KvCacheStats {
  int32_t total_blocks = 0;
  int32_t free_blocks = 0;
  int32_t used_blocks = 0;
  int32_t num_sequences = 0;
  int32_t detached_blocks = 0;  // held by leases and imports (in used_blocks)
};

// Not thread-safe: the engine thread owns it; others read snapshots the
// engine publishes.
class KvCacheManager {
 public:
  // `max_model_len` caps every sequence's length (tokens).
  KvCacheManager(int32_t num_blocks, int32_t block_size, int32_t max_model_len);

  // Reserves space for one step. All-or-nothing: on any error nothing
  // changes (no sequence created, no block allocated, no length advanced).
  // Errors: INVALID_ARGUMENT (empty id, num_new_tokens <= 0, id twice in one
  // step, length past max_model_len), NOT_FOUND / ALREADY_EXISTS per
  // `creation`, RESOURCE_EXHAUSTED (not enough free blocks for the step).
  absl::StatusOr<StepReservation> Append(
      absl::Span<const SequenceAppend> appends);
  // Reverts a reservation returned by the latest Append (the step failed).
  void Undo(const StepReservation& reservation);

  // Frees a sequence's blocks. NOT_FOUND when unknown.
  absl::Status Free(absl::string_view sequence_id);

  // Shortens a sequence to its first `num_tokens` tokens and frees the blocks
  // past them (their K/V bytes are simply dead). Undoes earlier steps, which
  // Undo cannot: the engine rolls back a chunked call whose later chunk
  // failed. NOT_FOUND when unknown; INVALID_ARGUMENT unless
  // 0 <= num_tokens <= the current length. Changes nothing on error.
  absl::Status Truncate(absl::string_view sequence_id, int32_t num_tokens);

  // --- KV handoff: blocks held outside the id table ---
  // A detached SequenceKv owns pool blocks that no sequence id names: a
  // prefill worker's lease, or a decode worker's import in progress. Its
  // blocks count as used until FreeDetached or Attach.

  // Removes a live sequence from the id table, keeping its blocks.
  // NOT_FOUND when unknown.
  absl::StatusOr<SequenceKv> Detach(absl::string_view sequence_id);
  // Allocates blocks for `num_tokens` tokens under no id (their bytes are
  // garbage until written). INVALID_ARGUMENT unless 0 < num_tokens <=
  // max_model_len; RESOURCE_EXHAUSTED when the pool is short.
  absl::StatusOr<SequenceKv> AllocateDetached(int32_t num_tokens);
  // Makes detached blocks the live sequence `sequence_id`. ALREADY_EXISTS
  // (nothing changes; the caller still owns `kv`) when the id is live.
  absl::Status Attach(absl::string_view sequence_id, SequenceKv& kv);
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
  int32_t block_size() const { return block_size_; }
  int32_t max_model_len() const { return max_model_len_; }
  int32_t max_blocks_per_seq() const {
    return (max_model_len_ + block_size_ - 1) / block_size_;
  }

 private:
  int32_t BlocksFor(int32_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }

  BlockPool pool_;
  int32_t block_size_;
  int32_t max_model_len_;
  absl::flat_hash_map<std::string, SequenceKv> sequences_;
  int32_t detached_blocks_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_CACHE_KV_CACHE_MANAGER_H_
