#include "tools/router/byte_tokenizer.h"

#include "absl/strings/str_cat.h"

namespace pdworker::router {

std::vector<int32_t> ByteTokenizer::Encode(absl::string_view text) {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  // Through unsigned char: bytes >= 0x80 must give 128..255, not negatives.
  for (const char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string ByteTokenizer::DecodeOne(int32_t id) {
  if (id >= 0 && id < kVocabSize) {
    return std::string(1, static_cast<char>(static_cast<unsigned char>(id)));
  }
  return absl::StrCat("<", id, ">");
}

std::string ByteTokenizer::Decode(absl::Span<const int32_t> ids) {
  std::string text;
  text.reserve(ids.size());
  for (const int32_t id : ids) text += DecodeOne(id);
  return text;
}

}  // namespace pdworker::router
