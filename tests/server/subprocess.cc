#include "tests/server/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace pdworker::server_testing {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::vector<std::string>& argv, const std::string& output_path,
    const std::vector<std::string>& extra_env) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  for (const std::string& e : extra_env) env_storage.push_back(e);
  std::vector<char*> env;
  env.reserve(env_storage.size() + 1);
  for (const std::string& e : env_storage) {
    env.push_back(const_cast<char*>(e.c_str()));
  }
  env.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // The child starts with no blocked signals, whatever this thread has.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty;
  sigemptyset(&empty);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, args[0], &actions, &attr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("posix_spawn ", argv[0], " failed: errno ", rc));
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid, output_path));
}

Subprocess::~Subprocess() {
  if (!Reap()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

std::string Subprocess::Output() const {
  std::ifstream in(output_path_);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool Subprocess::Reap() {
  if (exited_) return true;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
  exited_ = true;
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return true;
}

absl::StatusOr<std::string> Subprocess::WaitForOutput(absl::string_view needle,
                                                      absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  for (;;) {
    std::string text = Output();
    if (absl::StrContains(text, needle)) return text;
    if (Reap()) {
      return absl::FailedPreconditionError(
          absl::StrCat("exited with ", exit_code_, " before printing '", needle,
                       "':\n", Output()));
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("no '", needle, "' after ",
                       absl::FormatDuration(timeout), ":\n", text));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Subprocess::Signal(int signal_number) {
  if (!exited_) kill(pid_, signal_number);
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (!Reap()) {
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError("child still running");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return exit_code_;
}

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir ? srcdir : ".", "/",
                      workspace ? workspace : "pdworker", "/",
                      workspace_relative);
}

}  // namespace pdworker::server_testing
