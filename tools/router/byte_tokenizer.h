// ByteTokenizer: the demo's text <-> token id mapping. One token per UTF-8
// byte (id = the byte's value, 0..255), so any text round-trips and every id
// fits the tiny models' 256-token vocabulary. Real deployments tokenize in
// their own router; this only makes the reference router usable with text.
#ifndef PDWORKER_TOOLS_ROUTER_BYTE_TOKENIZER_H_
#define PDWORKER_TOOLS_ROUTER_BYTE_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pdworker::router {

class ByteTokenizer {
 public:
  // Ids a byte can map to: [0, kVocabSize).
  static constexpr int32_t kVocabSize = 256;

  // One id per byte of `text` (not per code point).
  static std::vector<int32_t> Encode(absl::string_view text);

  // The bytes back: ids in [0, 256) become that byte; any other id (a model
  // with a larger vocabulary) becomes "<id>" so nothing is dropped silently.
  static std::string Decode(absl::Span<const int32_t> ids);
  static std::string DecodeOne(int32_t id);
};

}  // namespace pdworker::router

#endif  // PDWORKER_TOOLS_ROUTER_BYTE_TOKENIZER_H_
