// Runs a shell command from a test, capturing stdout and stderr.
#ifndef PDWORKER_TESTS_MODEL_COMMAND_H_
#define PDWORKER_TESTS_MODEL_COMMAND_H_

#include <string>

#include "absl/status/statusor.h"

namespace pdworker::model_testing {

// Runs `command` with /bin/sh. Returns its stdout when it exits 0; otherwise
// Internal with the exit status and the captured stderr.
absl::StatusOr<std::string> RunCommand(const std::string& command);

}  // namespace pdworker::model_testing

#endif  // PDWORKER_TESTS_MODEL_COMMAND_H_
