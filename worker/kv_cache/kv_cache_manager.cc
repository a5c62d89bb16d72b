#include "worker/kv_cache/kv_cache_manager.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

KvCacheManager::KvCacheManager(int32_t num_blocks, int32_t block_size,
                               int32_t max_model_len)
    : pool_(num_blocks),
      block_size_(block_size),
      max_model_len_(max_model_len) {
  CHECK_GT(block_size, 0);
  CHECK_GT(max_model_len, 0);
}

absl::StatusOr<StepReservation> KvCacheManager::Append(
    absl::Span<const SequenceAppend> appends) {
  // Pass 1: validate everything and count blocks, touching nothing.
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(appends.size());
  int64_t blocks_needed = 0;
  for (const SequenceAppend& a : appends) {
    if (a.sequence_id.empty()) {
      return absl::InvalidArgumentError("sequence_id must not be empty");
    }
    if (!seen.insert(a.sequence_id).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", a.sequence_id, "' appears twice in one step"));
    }
    if (a.num_new_tokens <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", a.sequence_id,
          "': num_new_tokens must be positive, got ", a.num_new_tokens));
    }
    auto it = sequences_.find(a.sequence_id);
    const bool known = it != sequences_.end();
    if (!known && a.creation == SequenceCreation::kMustExist) {
      return absl::NotFoundError(
          absl::StrCat("unknown sequence '", a.sequence_id, "'"));
    }
    if (known && a.creation == SequenceCreation::kMustBeNew) {
      return absl::AlreadyExistsError(
          absl::StrCat("sequence '", a.sequence_id, "' already exists"));
    }
    const int32_t current = known ? it->second.num_tokens : 0;
    const int64_t target = static_cast<int64_t>(current) + a.num_new_tokens;
    if (target > max_model_len_) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", a.sequence_id, "' would reach ", target,
                       " tokens, beyond max_model_len=", max_model_len_));
    }
    const int32_t have =
        known ? static_cast<int32_t>(it->second.blocks.size()) : 0;
    blocks_needed += BlocksFor(static_cast<int32_t>(target)) - have;
  }
  if (blocks_needed > pool_.num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: step needs ", blocks_needed, " blocks, ",
                     pool_.num_free(), " of ", pool_.num_blocks(), " free"));
  }

  // Pass 2: apply. Cannot fail: blocks were counted above.
  StepReservation reservation;
  reservation.entries.reserve(appends.size());
  const auto now = std::chrono::steady_clock::now();
  for (const SequenceAppend& a : appends) {
    auto [it, created] = sequences_.try_emplace(a.sequence_id);
    SequenceKv& seq = it->second;
    reservation.entries.push_back({std::string(a.sequence_id), created,
                                   seq.num_tokens,
                                   static_cast<int32_t>(seq.blocks.size())});
    seq.num_tokens += a.num_new_tokens;
    seq.last_active = now;
    const int32_t missing =
        BlocksFor(seq.num_tokens) - static_cast<int32_t>(seq.blocks.size());
    const absl::Status allocated = pool_.Allocate(missing, &seq.blocks);
    CHECK(allocated.ok()) << allocated;
  }
  return reservation;
}

void KvCacheManager::Undo(const StepReservation& reservation) {
  // Reverse order restores the pool's LIFO order as well as the counts.
  for (auto e = reservation.entries.rbegin(); e != reservation.entries.rend();
       ++e) {
    auto it = sequences_.find(e->sequence_id);
    CHECK(it != sequences_.end()) << "undo of unknown " << e->sequence_id;
    SequenceKv& seq = it->second;
    CHECK_GE(static_cast<int32_t>(seq.blocks.size()), e->previous_num_blocks);
    pool_.Free(absl::MakeConstSpan(seq.blocks).subspan(e->previous_num_blocks));
    seq.blocks.resize(e->previous_num_blocks);
    seq.num_tokens = e->previous_num_tokens;
    if (e->created) sequences_.erase(it);
  }
}

absl::Status KvCacheManager::Free(absl::string_view sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  pool_.Free(it->second.blocks);
  sequences_.erase(it);
  return absl::OkStatus();
}

absl::Status KvCacheManager::Truncate(absl::string_view sequence_id,
                                      int32_t num_tokens) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  SequenceKv& seq = it->second;
  if (num_tokens < 0 || num_tokens > seq.num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot truncate sequence '", sequence_id, "' of ",
                     seq.num_tokens, " tokens to ", num_tokens));
  }
  const int32_t keep = BlocksFor(num_tokens);
  pool_.Free(absl::MakeConstSpan(seq.blocks).subspan(keep));
  seq.blocks.resize(keep);
  seq.num_tokens = num_tokens;
  return absl::OkStatus();
}

absl::StatusOr<SequenceKv> KvCacheManager::Detach(
    absl::string_view sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  SequenceKv kv = std::move(it->second);
  sequences_.erase(it);
  detached_blocks_ += static_cast<int32_t>(kv.blocks.size());
  return kv;
}

absl::StatusOr<SequenceKv> KvCacheManager::AllocateDetached(
    int32_t num_tokens) {
  if (num_tokens <= 0 || num_tokens > max_model_len_) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens ", num_tokens,
                     " outside [1, max_model_len=", max_model_len_, "]"));
  }
  SequenceKv kv;
  const int32_t blocks = BlocksFor(num_tokens);
  if (blocks > pool_.num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: ", num_tokens, " tokens need ", blocks, " blocks, ",
        pool_.num_free(), " of ", pool_.num_blocks(), " free"));
  }
  const absl::Status allocated = pool_.Allocate(blocks, &kv.blocks);
  CHECK(allocated.ok()) << allocated;
  kv.num_tokens = num_tokens;
  detached_blocks_ += blocks;
  return kv;
}

absl::Status KvCacheManager::Attach(absl::string_view sequence_id,
                                    SequenceKv& kv) {
  if (sequence_id.empty()) {
    return absl::InvalidArgumentError("sequence_id must not be empty");
  }
  auto [it, created] = sequences_.try_emplace(sequence_id);
  if (!created) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence '", sequence_id, "' already exists"));
  }
  detached_blocks_ -= static_cast<int32_t>(kv.blocks.size());
  CHECK_GE(detached_blocks_, 0);
  it->second = std::move(kv);
  it->second.last_active = std::chrono::steady_clock::now();
  kv = SequenceKv{};
  return absl::OkStatus();
}

void KvCacheManager::FreeDetached(SequenceKv& kv) {
  detached_blocks_ -= static_cast<int32_t>(kv.blocks.size());
  CHECK_GE(detached_blocks_, 0);
  pool_.Free(kv.blocks);
  kv = SequenceKv{};
}

const SequenceKv* KvCacheManager::Find(absl::string_view sequence_id) const {
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? nullptr : &it->second;
}

std::vector<std::string> KvCacheManager::IdleSince(
    std::chrono::steady_clock::time_point cutoff) const {
  std::vector<std::string> idle;
  for (const auto& [id, seq] : sequences_) {
    if (seq.last_active < cutoff) idle.push_back(id);
  }
  std::sort(idle.begin(), idle.end());
  return idle;
}

int32_t KvCacheManager::SlotFor(const SequenceKv& seq, int32_t position) const {
  CHECK(position >= 0 && position < seq.num_tokens)
      << "position " << position << " outside [0, " << seq.num_tokens << ")";
  return seq.blocks[position / block_size_] * block_size_ +
         position % block_size_;
}

KvCacheStats KvCacheManager::Stats() const {
  return {pool_.num_blocks(), pool_.num_free(), pool_.num_used(),
          static_cast<int32_t>(sequences_.size()), detached_blocks_};
}

}  // namespace pdworker
