// CheckTokenIds: the one check that token ids lie in a model's vocabulary,
// for every place that accepts ids from outside (Forward inputs, Generate
// prompts and stop ids, engine requests, KV imports, the runner's steps).
#ifndef PDWORKER_COMMON_TOKEN_IDS_H_
#define PDWORKER_COMMON_TOKEN_IDS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// OK when every id is in [0, vocab_size). Otherwise INVALID_ARGUMENT naming
// the first bad one: "<field>[<i>]=<id> is outside the vocabulary [0, V)".
// `Ids` is any indexable list of integers: a vector or span of int32, or a
// protobuf repeated field (uint32 in SMG's protos).
template <typename Ids>
absl::Status CheckTokenIds(absl::string_view field, const Ids& ids,
                           int64_t vocab_size) {
  for (size_t i = 0; i < static_cast<size_t>(ids.size()); ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]=", id,
                       " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdworker

#endif  // PDWORKER_COMMON_TOKEN_IDS_H_
