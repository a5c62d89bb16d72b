#include "worker/kv_cache/kv_cache_spec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdworker {

int64_t KvCacheSpec::ElementsPerBlockPerLayer() const {
  return static_cast<int64_t>(block_size) * num_kv_heads * head_dim;
}

int64_t KvCacheSpec::BytesPerBlock() const {
  // 2 = key + value.
  return 2 * static_cast<int64_t>(num_layers) * ElementsPerBlockPerLayer() *
         dtype_bytes;
}

int KvCacheSpec::MaxBlocksPerSeq() const {
  return (max_model_len + block_size - 1) / block_size;
}

std::string KvCacheSpec::ToString() const {
  return absl::StrCat("KvCacheSpec{layers=", num_layers,
                      " kv_heads=", num_kv_heads, " head_dim=", head_dim,
                      " block_size=", block_size, " dtype_bytes=", dtype_bytes,
                      " max_model_len=", max_model_len, "}");
}

absl::StatusOr<int64_t> NumBlocksForBudget(const KvCacheSpec& spec,
                                           int64_t budget_bytes) {
  if (spec.num_layers <= 0 || spec.num_kv_heads <= 0 || spec.head_dim <= 0 ||
      spec.block_size <= 0 || spec.dtype_bytes <= 0 ||
      spec.max_model_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid KV cache spec: ", spec.ToString()));
  }
  if (budget_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_cache_bytes must be positive, got ", budget_bytes));
  }
  const int64_t per_block = spec.BytesPerBlock();
  const int64_t blocks = budget_bytes / per_block;
  if (blocks < spec.MaxBlocksPerSeq()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv_cache_bytes=", budget_bytes, " holds ", blocks,
        " blocks but one sequence of max_model_len=", spec.max_model_len,
        " needs ", spec.MaxBlocksPerSeq(), " blocks of ", per_block,
        " bytes (at least ", spec.MaxBlocksPerSeq() * per_block, " bytes)"));
  }
  return blocks;
}

}  // namespace pdworker
