// Fuzz target: --compilation-config (dispatcher/compilation_config.h) on
// arbitrary text. It is refused with INVALID_ARGUMENT, or parsed into a
// config whose canonical JSON parses back to the same config.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "dispatcher/compilation_config.h"
#include "glog/logging.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = ParseCompilationConfig(text);
  if (!config.ok()) {
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument)
        << config.status();
    CHECK(!config.status().message().empty());
    return 0;
  }
  const std::string json = config->ToJson();
  auto again = ParseCompilationConfig(json);
  CHECK(again.ok()) << json << ": " << again.status();
  CHECK_EQ(again->ToJson(), json);
  return 0;
}
