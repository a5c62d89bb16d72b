#include "tests/metrics/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace pdworker::testing {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::vector<std::string>& argv, const std::string& output_path,
    const std::string& stdin_path) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv)
    args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string in = stdin_path.empty() ? "/dev/null" : stdin_path;
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, in.c_str(), O_RDONLY,
                                   0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot start ", absl::StrJoin(argv, " "), ": ", strerror(rc)));
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid, output_path));
}

Subprocess::~Subprocess() { Stop(); }

bool Subprocess::Reap() {
  if (exited_) return true;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_ || (r < 0 && errno == ECHILD)) {
    exited_ = true;
    wait_status_ = status;
  }
  return exited_;
}

bool Subprocess::Running() { return !Reap(); }

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!Reap()) {
    if (absl::Now() >= deadline) {
      Stop(absl::ZeroDuration());
      return absl::DeadlineExceededError(absl::StrCat(
          "child did not exit within ", absl::FormatDuration(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return wait_status_;
}

int Subprocess::Stop(absl::Duration grace) {
  if (Reap()) return wait_status_;
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  while (!Reap() && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!exited_) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    exited_ = true;
    wait_status_ = status;
  }
  return wait_status_;
}

std::string Subprocess::Output() const { return ReadFile(output_path_); }

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         const std::string& stdin_path,
                                         const std::string& output_path,
                                         absl::Duration timeout) {
  // Fresh output file: the result is this run's output only.
  std::ofstream(output_path, std::ios::trunc).close();
  absl::StatusOr<std::unique_ptr<Subprocess>> child =
      Subprocess::Start(argv, output_path, stdin_path);
  if (!child.ok()) return child.status();
  absl::StatusOr<int> status = (*child)->Wait(timeout);
  if (!status.ok()) return status.status();
  CommandResult result;
  result.exit_code = WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  result.output = ReadFile(output_path);
  return result;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

}  // namespace pdworker::testing
