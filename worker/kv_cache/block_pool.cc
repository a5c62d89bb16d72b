#include "worker/kv_cache/block_pool.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks),
      ref_count_(num_blocks, 0),
      hash_(num_blocks),
      prev_(num_blocks, -1),
      next_(num_blocks, -1) {
  CHECK_GE(num_blocks, 0);
  free_.reserve(num_blocks);
  // Highest id at the bottom so block 0 is handed out first (readable logs).
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

void BlockPool::CheckId(int32_t block) const {
  CHECK(block >= 0 && block < num_blocks_)
      << "block id out of range: " << block;
}

absl::Status BlockPool::Allocate(int32_t count, std::vector<int32_t>* out,
                                 std::vector<BlockHash>* evicted) {
  CHECK_GE(count, 0);
  if (count > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: need ", count, " blocks, ", num_free(),
                     " of ", num_blocks_, " free"));
  }
  for (int32_t i = 0; i < count; ++i) {
    if (free_.empty()) {
      // Evict the least recently freed cached block: Uncache makes it a
      // plain free block.
      std::optional<BlockHash> hash = Uncache(head_);
      if (evicted != nullptr) evicted->push_back(*hash);
      ++num_evictions_;
    }
    const int32_t b = free_.back();
    free_.pop_back();
    ref_count_[b] = 1;
    out->push_back(b);
  }
  return absl::OkStatus();
}

void BlockPool::Free(absl::Span<const int32_t> blocks) {
  // Reverse order: the tail's cached blocks are queued first, so evicted
  // first, and never-cached blocks go back LIFO as they came out.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    CheckId(b);
    CHECK_GT(ref_count_[b], 0) << "double free of KV block " << b;
    if (--ref_count_[b] > 0) continue;
    if (hash_[b].has_value()) {
      PushEvictable(b);
    } else {
      free_.push_back(b);
    }
  }
}

void BlockPool::Ref(int32_t block) {
  CheckId(block);
  if (ref_count_[block] == 0) {
    CHECK(hash_[block].has_value()) << "Ref of free uncached block " << block;
    RemoveEvictable(block);
  }
  ++ref_count_[block];
}

std::optional<int32_t> BlockPool::Lookup(const BlockHash& hash) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  return it->second;
}

bool BlockPool::Cache(int32_t block, const BlockHash& hash) {
  CheckId(block);
  CHECK_GT(ref_count_[block], 0) << "caching free block " << block;
  if (hash_[block].has_value()) return false;
  if (!by_hash_.try_emplace(hash, block).second) return false;
  hash_[block] = hash;
  return true;
}

std::optional<BlockHash> BlockPool::Uncache(int32_t block) {
  CheckId(block);
  std::optional<BlockHash> hash = std::move(hash_[block]);
  if (!hash.has_value()) return std::nullopt;
  hash_[block].reset();
  by_hash_.erase(*hash);
  if (ref_count_[block] == 0) {
    // A free cached block: now a plain free block.
    RemoveEvictable(block);
    free_.push_back(block);
  }
  return hash;
}

void BlockPool::UncacheAll() {
  while (head_ != -1) {
    const int32_t b = head_;
    RemoveEvictable(b);
    free_.push_back(b);
  }
  for (std::optional<BlockHash>& h : hash_) h.reset();
  by_hash_.clear();
}

void BlockPool::PushEvictable(int32_t block) {
  prev_[block] = tail_;
  next_[block] = -1;
  if (tail_ != -1) {
    next_[tail_] = block;
  } else {
    head_ = block;
  }
  tail_ = block;
  ++num_evictable_;
}

void BlockPool::RemoveEvictable(int32_t block) {
  if (prev_[block] != -1) {
    next_[prev_[block]] = next_[block];
  } else {
    head_ = next_[block];
  }
  if (next_[block] != -1) {
    prev_[next_[block]] = prev_[block];
  } else {
    tail_ = prev_[block];
  }
  prev_[block] = next_[block] = -1;
  --num_evictable_;
}

}  // namespace pdworker
