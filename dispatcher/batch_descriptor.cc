#include "dispatcher/batch_descriptor.h"

#include "absl/strings/str_format.h"

namespace pdworker {

std::string BatchDescriptor::ToString() const {
  return absl::StrFormat(
      "BatchDescriptor(num_tokens=%d, num_reqs=%d, uniform=%s)", num_tokens,
      num_reqs, uniform ? "true" : "false");
}

std::ostream& operator<<(std::ostream& os, const BatchDescriptor& d) {
  return os << d.ToString();
}

std::ostream& operator<<(std::ostream& os, BatchKind kind) {
  switch (kind) {
    case BatchKind::kUniformDecode:
      return os << "uniform_decode";
    case BatchKind::kOneTokenDecode:
      return os << "one_token_decode";
    case BatchKind::kMixed:
      break;
  }
  return os << "mixed";
}

}  // namespace pdworker
