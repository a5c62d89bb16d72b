// The vLLM-style --compilation_config JSON, e.g.
//   {"cudagraph_mode": "FULL_AND_PIECEWISE",
//    "cudagraph_capture_sizes": [1, 2, 4, 8],
//    "max_cudagraph_capture_size": 8}
// Every field is optional; absent (or null) fields keep the role defaults.
#ifndef PDWORKER_DISPATCHER_COMPILATION_CONFIG_H_
#define PDWORKER_DISPATCHER_COMPILATION_CONFIG_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

struct CompilationConfig {
  std::optional<CudaGraphMode> cudagraph_mode;
  std::optional<std::vector<int>> cudagraph_capture_sizes;
  std::optional<int> max_cudagraph_capture_size;

  // Canonical JSON of the fields that are set, e.g. for the info metric.
  std::string ToJson() const;
};

// Parses the JSON text. An empty (or all-whitespace) string is an empty
// config. Errors are InvalidArgument and name the offending field, e.g.
// "compilation_config.cudagraph_capture_sizes[2] must be an integer, got
// string". Unknown fields are rejected (listing the known ones) so a typo
// never silently keeps a default. Range checks against the scheduler limits
// happen later, in ResolveCaptureSizes.
absl::StatusOr<CompilationConfig> ParseCompilationConfig(
    absl::string_view json_text);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_COMPILATION_CONFIG_H_
