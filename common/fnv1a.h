// 64-bit FNV-1a: tiny, well known, and identical on every platform, so
// fingerprints and derived seeds agree across machines and builds.
#ifndef PDWORKER_COMMON_FNV1A_H_
#define PDWORKER_COMMON_FNV1A_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace pdworker {

inline uint64_t Fnv1a64(absl::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace pdworker

#endif  // PDWORKER_COMMON_FNV1A_H_
