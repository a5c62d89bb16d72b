// Subprocess: a child program for tests (posix_spawn), with its stdout and
// stderr in a file, stopped (SIGTERM, then SIGKILL) on destruction.
#ifndef PDWORKER_TESTS_METRICS_SUBPROCESS_H_
#define PDWORKER_TESTS_METRICS_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdworker::testing {

class Subprocess {
 public:
  // Runs argv[0] (an absolute path) with `argv`, stdin from `stdin_path`
  // (/dev/null when empty), stdout and stderr appended to `output_path`.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(
      const std::vector<std::string>& argv, const std::string& output_path,
      const std::string& stdin_path = "");

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();  // Stop()

  // Whether the child is still running (reaps it if it exited).
  bool Running();

  // SIGTERM, up to `grace` for it to exit, then SIGKILL. Returns the wait
  // status (see waitpid); idempotent.
  int Stop(absl::Duration grace = absl::Seconds(10));

  // Waits for the child to exit on its own, up to `timeout` (then kills it).
  // DEADLINE_EXCEEDED on timeout; otherwise the wait status.
  absl::StatusOr<int> Wait(absl::Duration timeout);

  const std::string& output_path() const { return output_path_; }
  // The child's output so far.
  std::string Output() const;

 private:
  Subprocess(pid_t pid, std::string output_path)
      : pid_(pid), output_path_(std::move(output_path)) {}

  // Non-blocking reap; true once the child has exited.
  bool Reap();

  pid_t pid_;
  bool exited_ = false;
  int wait_status_ = 0;
  std::string output_path_;
};

// Runs a program to completion (bounded by `timeout`) and returns its exit
// code and combined stdout+stderr.
struct CommandResult {
  int exit_code = -1;  // -1: killed by a signal
  std::string output;
};
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         const std::string& stdin_path,
                                         const std::string& output_path,
                                         absl::Duration timeout);

// Reads a whole file; "" if it cannot be read.
std::string ReadFile(const std::string& path);

}  // namespace pdworker::testing

#endif  // PDWORKER_TESTS_METRICS_SUBPROCESS_H_
