#include "worker/kv_cache/kv_cache_manager.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

// The leading full blocks of `token_ids` whose ids are all known, hashed.
std::vector<BlockHash> HashKnownBlocks(const BlockHasher& hasher,
                                       absl::Span<const int32_t> token_ids) {
  const int32_t bs = hasher.block_size();
  int32_t known = 0;
  while (known < static_cast<int32_t>(token_ids.size()) &&
         token_ids[known] != kUnknownTokenId) {
    ++known;
  }
  std::vector<BlockHash> hashes;
  hashes.reserve(known / bs);
  hasher.HashFullBlocks(token_ids.first(known), &hashes);
  return hashes;
}

}  // namespace

KvCacheManager::KvCacheManager(int32_t num_blocks, int32_t block_size,
                               int32_t max_model_len,
                               PrefixCacheConfig prefix_cache)
    : pool_(num_blocks),
      block_size_(block_size),
      max_model_len_(max_model_len),
      prefix_cache_(std::move(prefix_cache)),
      hasher_(prefix_cache_.salt,
              std::min(std::max(block_size, 1), kMaxHashedBlockSize)) {
  CHECK_GT(block_size, 0);
  CHECK_GT(max_model_len, 0);
  CHECK(!caching() || block_size <= kMaxHashedBlockSize)
      << "prefix caching needs block_size <= " << kMaxHashedBlockSize;
}

absl::StatusOr<StepReservation> KvCacheManager::Append(
    absl::Span<const SequenceAppend> appends) {
  // Pass 1: validate everything, look up the prefixes of sequences the step
  // creates, and count blocks, touching nothing.
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(appends.size());
  struct Lookup {
    std::vector<BlockHash> hashes;
    PrefixHit hit;
  };
  std::vector<Lookup> lookups(appends.size());
  int64_t blocks_needed = 0;
  for (size_t k = 0; k < appends.size(); ++k) {
    const SequenceAppend& a = appends[k];
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
    if (a.computed_tail_tokens < 1 ||
        a.computed_tail_tokens > a.num_new_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", a.sequence_id,
                       "': computed_tail_tokens=", a.computed_tail_tokens,
                       " outside [1, num_new_tokens=", a.num_new_tokens, "]"));
    }
    if (!a.token_ids.empty() &&
        static_cast<int32_t>(a.token_ids.size()) != a.num_new_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", a.sequence_id, "': ", a.token_ids.size(),
                       " token ids for ", a.num_new_tokens, " new tokens"));
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
    if (!known && caching() && !a.token_ids.empty()) {
      lookups[k].hashes = HashKnownBlocks(hasher_, a.token_ids);
      // FindPrefix keeps the last of the tokens it is given out of the hit.
      lookups[k].hit = FindPrefix(
          lookups[k].hashes, a.num_new_tokens - a.computed_tail_tokens + 1);
    }
    const int32_t have =
        known ? static_cast<int32_t>(it->second.blocks.size()) : 0;
    // A hit on a block nobody holds takes it out of the free blocks just as
    // allocating one would.
    blocks_needed += BlocksFor(static_cast<int32_t>(target)) - have -
                     lookups[k].hit.num_held_blocks;
  }
  if (blocks_needed > pool_.num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: step needs ", blocks_needed, " blocks, ",
                     pool_.num_free(), " of ", pool_.num_blocks(), " free"));
  }

  // Pass 2: apply. Cannot fail: blocks were counted above. Every hit is
  // taken before any allocation, which could otherwise evict it.
  StepReservation reservation;
  reservation.entries.reserve(appends.size());
  const auto now = std::chrono::steady_clock::now();
  for (size_t k = 0; k < appends.size(); ++k) {
    const SequenceAppend& a = appends[k];
    auto [it, created] = sequences_.try_emplace(a.sequence_id);
    SequenceKv& seq = it->second;
    reservation.entries.push_back(
        {std::string(a.sequence_id), created, seq.num_tokens,
         static_cast<int32_t>(seq.blocks.size()),
         static_cast<int32_t>(seq.block_hashes.size()), 0});
    if (!created || !caching() || a.token_ids.empty()) continue;
    const Lookup& lookup = lookups[k];
    const int32_t cached = lookup.hit.num_blocks * block_size_;
    TakePrefix(absl::MakeConstSpan(lookup.hashes).first(lookup.hit.num_blocks),
               &seq.blocks);
    seq.block_hashes.assign(lookup.hashes.begin(),
                            lookup.hashes.begin() + lookup.hit.num_blocks);
    seq.token_ids.assign(a.token_ids.begin(), a.token_ids.begin() + cached);
    seq.num_tokens = cached;
    reservation.entries.back().cached_tokens = cached;
    query_tokens_ += a.num_new_tokens;
    hit_tokens_ += cached;
  }
  for (size_t k = 0; k < appends.size(); ++k) {
    const SequenceAppend& a = appends[k];
    SequenceKv& seq = sequences_.find(a.sequence_id)->second;
    const StepReservation::Entry& entry = reservation.entries[k];
    const int32_t computed = a.num_new_tokens - entry.cached_tokens;
    if (caching()) {
      if (a.token_ids.empty()) {
        seq.token_ids.insert(seq.token_ids.end(), computed, kUnknownTokenId);
      } else {
        seq.token_ids.insert(seq.token_ids.end(), a.token_ids.end() - computed,
                             a.token_ids.end());
      }
    }
    seq.num_tokens += computed;
    seq.last_active = now;
    const int32_t missing =
        BlocksFor(seq.num_tokens) - static_cast<int32_t>(seq.blocks.size());
    AllocateBlocks(missing, &seq.blocks);
    CacheFullBlocks(seq);
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
    // Blocks the step cached hold K/V it never wrote: uncache them. Nobody
    // can share them yet (only a later step looks them up).
    std::vector<BlockHash> removed;
    const int32_t first_cached_here =
        std::max(e->previous_num_hashes, e->cached_tokens / block_size_);
    for (int32_t b = first_cached_here;
         b < static_cast<int32_t>(seq.block_hashes.size()); ++b) {
      const int32_t block = seq.blocks[b];
      if (pool_.Lookup(seq.block_hashes[b]) != block) continue;
      CHECK_EQ(pool_.ref_count(block), 1) << "undo of a shared block";
      removed.push_back(*pool_.Uncache(block));
    }
    RecordRemoved(removed);
    FreeHeld(absl::MakeConstSpan(seq.blocks).subspan(e->previous_num_blocks));
    seq.blocks.resize(e->previous_num_blocks);
    seq.num_tokens = e->previous_num_tokens;
    if (caching()) {
      seq.token_ids.resize(e->previous_num_tokens);
      seq.block_hashes.resize(e->previous_num_hashes);
    }
    if (e->created) sequences_.erase(it);
  }
}

absl::StatusOr<int32_t> KvCacheManager::StartSequence(
    absl::string_view sequence_id, absl::Span<const int32_t> token_ids) {
  if (sequence_id.empty()) {
    return absl::InvalidArgumentError("sequence_id must not be empty");
  }
  if (static_cast<int64_t>(token_ids.size()) > max_model_len_) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence '", sequence_id, "': ", token_ids.size(),
                     " tokens, beyond max_model_len=", max_model_len_));
  }
  if (sequences_.contains(sequence_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence '", sequence_id, "' already exists"));
  }
  SequenceKv& seq = sequences_[sequence_id];
  seq.last_active = std::chrono::steady_clock::now();
  if (!caching()) return 0;
  std::vector<BlockHash> hashes = HashKnownBlocks(hasher_, token_ids);
  const PrefixHit hit =
      FindPrefix(hashes, static_cast<int32_t>(token_ids.size()));
  TakePrefix(absl::MakeConstSpan(hashes).first(hit.num_blocks), &seq.blocks);
  hashes.resize(hit.num_blocks);
  seq.block_hashes = std::move(hashes);
  seq.num_tokens = hit.num_blocks * block_size_;
  seq.token_ids.assign(token_ids.begin(), token_ids.begin() + seq.num_tokens);
  query_tokens_ += static_cast<int64_t>(token_ids.size());
  hit_tokens_ += seq.num_tokens;
  return seq.num_tokens;
}

PrefixHit KvCacheManager::Lookup(absl::Span<const BlockHash> hashes,
                                 int32_t num_tokens) const {
  if (!caching()) return {};
  return FindPrefix(hashes, num_tokens);
}

PrefixHit KvCacheManager::FindPrefix(absl::Span<const BlockHash> hashes,
                                     int32_t num_tokens) const {
  // vLLM's rule: the last token is always computed (its logits are the
  // step's output), and so never lands in a shared block.
  const int32_t cap = num_tokens > 0 ? (num_tokens - 1) / block_size_ : 0;
  PrefixHit hit;
  for (int32_t b = 0; b < cap && b < static_cast<int32_t>(hashes.size()); ++b) {
    const std::optional<int32_t> block = pool_.Lookup(hashes[b]);
    if (!block.has_value()) break;
    ++hit.num_blocks;
    if (pool_.ref_count(*block) > 0) ++hit.num_held_blocks;
  }
  return hit;
}

void KvCacheManager::TakePrefix(absl::Span<const BlockHash> hashes,
                                std::vector<int32_t>* blocks) {
  for (const BlockHash& hash : hashes) {
    const int32_t block = *pool_.Lookup(hash);
    pool_.Ref(block);
    blocks->push_back(block);
  }
}

void KvCacheManager::SetTokenId(absl::string_view sequence_id, int32_t position,
                                int32_t token_id) {
  if (!caching()) return;
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return;
  SequenceKv& seq = it->second;
  if (position < 0 || position >= static_cast<int32_t>(seq.token_ids.size()) ||
      seq.token_ids[position] != kUnknownTokenId) {
    return;
  }
  seq.token_ids[position] = token_id;
  CacheFullBlocks(seq);
}

void KvCacheManager::CacheFullBlocks(SequenceKv& seq) {
  if (!caching()) return;
  const int32_t full = seq.num_tokens / block_size_;
  BlockStoredEvent stored;
  auto flush = [&] {
    if (stored.block_hashes.empty()) return;
    stored.block_size = block_size_;
    events_.emplace_back(std::move(stored));
    stored = BlockStoredEvent{};
  };
  for (int32_t b = static_cast<int32_t>(seq.block_hashes.size()); b < full;
       ++b) {
    const absl::Span<const int32_t> ids =
        absl::MakeConstSpan(seq.token_ids)
            .subspan(b * block_size_, block_size_);
    if (std::find(ids.begin(), ids.end(), kUnknownTokenId) != ids.end()) {
      break;
    }
    // A copy: the push_back below may move the vector.
    const BlockHash parent = b == 0 ? hasher_.root() : seq.block_hashes[b - 1];
    seq.block_hashes.push_back(hasher_.Hash(parent, ids));
    if (!pool_.Cache(seq.blocks[b], seq.block_hashes.back())) {
      // Another block holds these tokens already: this one stays private.
      flush();
      continue;
    }
    if (stored.block_hashes.empty() && b > 0) {
      stored.parent_block_hash = BlockHasher::External(parent);
    }
    stored.block_hashes.push_back(
        BlockHasher::External(seq.block_hashes.back()));
    stored.token_ids.insert(stored.token_ids.end(), ids.begin(), ids.end());
  }
  flush();
}

void KvCacheManager::RecordRemoved(absl::Span<const BlockHash> hashes) {
  if (hashes.empty()) return;
  BlockRemovedEvent removed;
  for (const BlockHash& h : hashes) {
    removed.block_hashes.push_back(BlockHasher::External(h));
  }
  events_.emplace_back(std::move(removed));
}

void KvCacheManager::AllocateBlocks(int32_t count, std::vector<int32_t>* out) {
  evicted_.clear();
  const absl::Status allocated = pool_.Allocate(count, out, &evicted_);
  CHECK(allocated.ok()) << allocated;
  RecordRemoved(evicted_);
}

void KvCacheManager::ClearPrefixCache() {
  if (!caching()) return;
  pool_.UncacheAll();
  events_.emplace_back(AllBlocksClearedEvent{});
}

void KvCacheManager::TakeEvents(std::vector<KvCacheEvent>* out) {
  for (KvCacheEvent& e : events_) out->push_back(std::move(e));
  events_.clear();
}

absl::Status KvCacheManager::Free(absl::string_view sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  FreeHeld(it->second.blocks);
  sequences_.erase(it);
  return absl::OkStatus();
}

void KvCacheManager::FreeHeld(absl::Span<const int32_t> blocks) {
  if (std::find(blocks.begin(), blocks.end(), kFreedBlock) == blocks.end()) {
    pool_.Free(blocks);
    return;
  }
  std::vector<int32_t> held;
  for (const int32_t block : blocks) {
    if (block != kFreedBlock) held.push_back(block);
  }
  pool_.Free(held);
}

bool KvCacheManager::HasFreedBlocks(const SequenceKv& seq) {
  return !seq.blocks.empty() && seq.blocks.front() == kFreedBlock;
}

absl::StatusOr<int32_t> KvCacheManager::FreeOutsideWindow(
    absl::string_view sequence_id, int32_t window) {
  if (window <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FreeOutsideWindow: window must be positive, got ", window));
  }
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  SequenceKv& seq = it->second;
  // Block b holds positions [b · size, (b + 1) · size); the next query (at
  // num_tokens) sees positions > num_tokens - window.
  const int64_t first_visible =
      std::max<int64_t>(0, int64_t{seq.num_tokens} - window + 1);
  int64_t dead = first_visible / block_size_;
  // Unhashed blocks would leave a hole in the cache's chain of hashes.
  if (caching()) {
    dead = std::min<int64_t>(dead, seq.block_hashes.size());
  }
  dead = std::min<int64_t>(dead, seq.blocks.size());
  std::vector<int32_t> freed;
  for (int64_t b = 0; b < dead; ++b) {
    if (seq.blocks[b] == kFreedBlock) continue;
    freed.push_back(seq.blocks[b]);
    seq.blocks[b] = kFreedBlock;
  }
  pool_.Free(freed);
  return static_cast<int32_t>(freed.size());
}

absl::Status KvCacheManager::Truncate(absl::string_view sequence_id,
                                      int32_t num_tokens,
                                      std::optional<BlockCopy>* copy) {
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
  if (HasFreedBlocks(seq) && num_tokens < seq.num_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot truncate sequence '", sequence_id,
                     "': blocks that left its attention window were freed"));
  }
  if (copy != nullptr) copy->reset();
  const int32_t keep = BlocksFor(num_tokens);
  // The block the cut falls inside is written again from the cut on.
  const int32_t partial = num_tokens % block_size_;
  if (partial != 0 && num_tokens < seq.num_tokens) {
    const int32_t index = keep - 1;
    const int32_t block = seq.blocks[index];
    if (pool_.ref_count(block) > 1) {
      // Shared: the others keep it; this sequence gets a copy.
      if (copy == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("truncating sequence '", sequence_id,
                         "' needs a copy of a shared KV block"));
      }
      if (pool_.num_free() < 1) {
        return absl::ResourceExhaustedError(
            absl::StrCat("truncating sequence '", sequence_id,
                         "' needs a free KV block to copy a shared one into"));
      }
      std::vector<int32_t> fresh;
      AllocateBlocks(1, &fresh);
      *copy = BlockCopy{block, fresh[0], partial};
      seq.blocks[index] = fresh[0];
      pool_.Free({block});
    } else if (index < static_cast<int32_t>(seq.block_hashes.size()) &&
               pool_.Lookup(seq.block_hashes[index]) == block) {
      const BlockHash removed[] = {*pool_.Uncache(block)};
      RecordRemoved(removed);
    }
  }
  FreeHeld(absl::MakeConstSpan(seq.blocks).subspan(keep));
  seq.blocks.resize(keep);
  seq.num_tokens = num_tokens;
  if (caching()) {
    seq.token_ids.resize(num_tokens);
    seq.block_hashes.resize(
        std::min<size_t>(seq.block_hashes.size(), num_tokens / block_size_));
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceKv> KvCacheManager::Detach(
    absl::string_view sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence '", sequence_id, "'"));
  }
  if (HasFreedBlocks(it->second)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot detach sequence '", sequence_id,
                     "': blocks that left its attention window were freed"));
  }
  SequenceKv kv = std::move(it->second);
  sequences_.erase(it);
  detached_blocks_ += static_cast<int32_t>(kv.blocks.size());
  return kv;
}

absl::StatusOr<SequenceKv> KvCacheManager::AllocateDetached(
    int32_t num_tokens, absl::Span<const int32_t> token_ids,
    int32_t* cached_tokens) {
  if (cached_tokens != nullptr) *cached_tokens = 0;
  if (num_tokens <= 0 || num_tokens > max_model_len_) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens ", num_tokens,
                     " outside [1, max_model_len=", max_model_len_, "]"));
  }
  if (!token_ids.empty() &&
      static_cast<int32_t>(token_ids.size()) != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        token_ids.size(), " token ids for ", num_tokens, " tokens"));
  }
  std::vector<BlockHash> hashes;
  PrefixHit hit;
  if (caching() && !token_ids.empty()) {
    hashes = HashKnownBlocks(hasher_, token_ids);
    hit = FindPrefix(hashes, num_tokens);
  }
  SequenceKv kv;
  const int32_t blocks = BlocksFor(num_tokens);
  // Hits on free cached blocks take them from the free blocks.
  if (blocks - hit.num_held_blocks > pool_.num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: ", num_tokens, " tokens need ", blocks, " blocks, ",
        pool_.num_free(), " of ", pool_.num_blocks(), " free"));
  }
  TakePrefix(absl::MakeConstSpan(hashes).first(hit.num_blocks), &kv.blocks);
  AllocateBlocks(blocks - hit.num_blocks, &kv.blocks);
  kv.num_tokens = num_tokens;
  if (caching()) {
    hashes.resize(hit.num_blocks);
    kv.block_hashes = std::move(hashes);
    if (token_ids.empty()) {
      kv.token_ids.assign(num_tokens, kUnknownTokenId);
    } else {
      kv.token_ids.assign(token_ids.begin(), token_ids.end());
      query_tokens_ += num_tokens;
      hit_tokens_ += hit.num_blocks * block_size_;
    }
  }
  if (cached_tokens != nullptr) *cached_tokens = hit.num_blocks * block_size_;
  detached_blocks_ += blocks;
  return kv;
}

absl::Status KvCacheManager::Attach(absl::string_view sequence_id,
                                    SequenceKv& kv,
                                    absl::Span<const int32_t> token_ids) {
  if (sequence_id.empty()) {
    return absl::InvalidArgumentError("sequence_id must not be empty");
  }
  if (!token_ids.empty() &&
      static_cast<int32_t>(token_ids.size()) != kv.num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence '", sequence_id, "': ", token_ids.size(),
                     " token ids for ", kv.num_tokens, " tokens"));
  }
  auto [it, created] = sequences_.try_emplace(sequence_id);
  if (!created) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence '", sequence_id, "' already exists"));
  }
  detached_blocks_ -= static_cast<int32_t>(kv.blocks.size());
  CHECK_GE(detached_blocks_, 0);
  it->second = std::move(kv);
  SequenceKv& seq = it->second;
  seq.last_active = std::chrono::steady_clock::now();
  if (caching()) {
    if (!token_ids.empty()) {
      seq.token_ids.assign(token_ids.begin(), token_ids.end());
    } else if (static_cast<int32_t>(seq.token_ids.size()) != seq.num_tokens) {
      seq.token_ids.assign(seq.num_tokens, kUnknownTokenId);
    }
    CacheFullBlocks(seq);
  }
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
  KvCacheStats s;
  s.total_blocks = pool_.num_blocks();
  s.free_blocks = pool_.num_free();
  s.used_blocks = pool_.num_used();
  s.num_sequences = static_cast<int32_t>(sequences_.size());
  for (const auto& [id, seq] : sequences_) s.used_tokens += seq.num_tokens;
  s.detached_blocks = detached_blocks_;
  s.cached_blocks = pool_.num_cached();
  s.evictions = pool_.num_evictions();
  s.query_tokens = query_tokens_;
  s.hit_tokens = hit_tokens_;
  return s;
}

}  // namespace pdworker
