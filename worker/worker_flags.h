// The pdworker process's flags: their definitions, their parsing and
// checking into one WorkerConfig (errors name the flag), vLLM's dashed
// spellings, and the grouped `--help` text.
#ifndef PDWORKER_WORKER_WORKER_FLAGS_H_
#define PDWORKER_WORKER_WORKER_FLAGS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "metrics/worker_metrics.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"
#include "worker/server/worker_server.h"

namespace pdworker {

// Everything the flags say, checked.
struct WorkerConfig {
  ModelRunnerOptions runner;
  std::string model_dir;
  std::string compilation_config_json;
  // nullopt: --device=auto (CUDA if usable, else CPU).
  std::optional<DeviceKind> device;
  CpuStreamExecution cpu_stream = CpuStreamExecution::kThreaded;
  WorkerServerOptions server;
  std::string metrics_address;  // empty: no metrics server
  VllmAliases metrics_vllm_aliases = VllmAliases::kOff;
  absl::Duration stats_log_interval;
};

// Reads every flag into a WorkerConfig; INVALID_ARGUMENT naming the flag
// ("--name: ...") when one is wrong.
absl::StatusOr<WorkerConfig> ConfigFromFlags();

// INVALID_ARGUMENT "--flag: message".
absl::Status FlagError(absl::string_view flag, absl::string_view message);

// argv with "--some-name[=v]" rewritten to "--some_name[=v]" when the latter
// is one of our flags (vLLM users write dashes; absl accepts underscores).
// Stops at "--".
std::vector<std::string> UnderscoreFlagNames(int argc, char** argv);

// Whether the arguments ask for help (before "--").
bool WantsHelp(const std::vector<std::string>& args);

// What `pdworker --help` prints: every flag worker_flags.cc defines, grouped,
// with its default.
std::string HelpText();

}  // namespace pdworker

#endif  // PDWORKER_WORKER_WORKER_FLAGS_H_
