#include "worker/kv_cache/block_pool.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks), is_free_(num_blocks, true) {
  CHECK_GE(num_blocks, 0);
  free_.reserve(num_blocks);
  // Highest id at the bottom so block 0 is handed out first (readable logs).
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

absl::Status BlockPool::Allocate(int32_t count, std::vector<int32_t>* out) {
  CHECK_GE(count, 0);
  if (count > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: need ", count, " blocks, ", num_free(),
                     " of ", num_blocks_, " free"));
  }
  for (int32_t i = 0; i < count; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    is_free_[b] = false;
    out->push_back(b);
  }
  return absl::OkStatus();
}

void BlockPool::Free(absl::Span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    CHECK(b >= 0 && b < num_blocks_) << "block id out of range: " << b;
    CHECK(!is_free_[b]) << "double free of KV block " << b;
    is_free_[b] = true;
    free_.push_back(b);
  }
}

}  // namespace pdworker
