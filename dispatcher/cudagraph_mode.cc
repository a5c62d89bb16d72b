#include "dispatcher/cudagraph_mode.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdworker {

absl::string_view RuntimeModeName(RuntimeMode mode) {
  switch (mode) {
    case RuntimeMode::kNone:
      return "NONE";
    case RuntimeMode::kPiecewise:
      return "PIECEWISE";
    case RuntimeMode::kFull:
      return "FULL";
  }
  return "UNKNOWN";
}

std::ostream& operator<<(std::ostream& os, RuntimeMode mode) {
  return os << RuntimeModeName(mode);
}

std::array<CudaGraphMode, 5> CudaGraphMode::All() {
  return {None(), Piecewise(), Full(), FullDecodeOnly(), FullAndPiecewise()};
}

std::string CudaGraphMode::ToString() const {
  if (*this == None()) return "NONE";
  if (*this == Piecewise()) return "PIECEWISE";
  if (*this == Full()) return "FULL";
  if (*this == FullDecodeOnly()) return "FULL_DECODE_ONLY";
  if (*this == FullAndPiecewise()) return "FULL_AND_PIECEWISE";
  // Unreachable through the public constructors; kept printable anyway.
  return absl::StrCat("(", RuntimeModeName(decode_), ", ",
                      RuntimeModeName(mixed_), ")");
}

std::string ToString(CudaGraphMode mode) { return mode.ToString(); }

absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(absl::string_view name) {
  const std::string upper =
      absl::AsciiStrToUpper(absl::StripAsciiWhitespace(name));
  std::vector<std::string> valid;
  for (CudaGraphMode mode : CudaGraphMode::All()) {
    std::string mode_name = mode.ToString();
    if (mode_name == upper) return mode;
    valid.push_back(std::move(mode_name));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown cudagraph_mode '", name,
                   "'; valid names: ", absl::StrJoin(valid, ", ")));
}

}  // namespace pdworker
