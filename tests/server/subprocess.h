// A child process for tests that run pdworker (or python) as a real program:
// started with posix_spawn, its stdout and stderr captured in one file.
#ifndef PDWORKER_TESTS_SERVER_SUBPROCESS_H_
#define PDWORKER_TESTS_SERVER_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace pdworker::server_testing {

class Subprocess {
 public:
  // Runs argv[0] (a path) with `argv`, the environment plus `extra_env`
  // ("NAME=value"), output to `output_path`.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(
      const std::vector<std::string>& argv, const std::string& output_path,
      const std::vector<std::string>& extra_env = {});

  // Kills (SIGKILL) and reaps the child if it still runs.
  ~Subprocess();

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Stdout and stderr so far.
  std::string Output() const;
  // Polls the output until it contains `needle`; DEADLINE_EXCEEDED after
  // `timeout` (a hung child), FAILED_PRECONDITION if the child exits first.
  absl::StatusOr<std::string> WaitForOutput(absl::string_view needle,
                                            absl::Duration timeout);
  void Signal(int signal_number);
  // The exit code (128 + N when killed by signal N); DEADLINE_EXCEEDED if
  // the child is still running after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);

 private:
  Subprocess(pid_t pid, std::string output_path)
      : pid_(pid), output_path_(std::move(output_path)) {}
  // Non-blocking reap; true once the child has exited.
  bool Reap();

  pid_t pid_;
  std::string output_path_;
  bool exited_ = false;
  int exit_code_ = -1;
};

// The runfiles path of a data dependency, e.g. "worker/pdworker".
std::string RunfilePath(const std::string& workspace_relative);

}  // namespace pdworker::server_testing

#endif  // PDWORKER_TESTS_SERVER_SUBPROCESS_H_
