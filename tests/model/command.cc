#include "tests/model/command.h"

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/model/test_paths.h"

namespace pdworker::model_testing {
namespace {

std::string ReadWholeFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::string> RunCommand(const std::string& command) {
  const std::string dir = MakeUniqueTempDir("command");
  const std::string out_path = dir + "/stdout";
  const std::string err_path = dir + "/stderr";
  const std::string full = absl::StrCat(command, " >", ShellQuote(out_path),
                                        " 2>", ShellQuote(err_path));
  const int raw = std::system(full.c_str());
  const std::string out = ReadWholeFile(out_path);
  const std::string err = ReadWholeFile(err_path);
  if (raw == -1) {
    return absl::InternalError(absl::StrCat("cannot run: ", command));
  }
  if (!WIFEXITED(raw) || WEXITSTATUS(raw) != 0) {
    const std::string how = WIFEXITED(raw)
                                ? absl::StrCat("exited with ", WEXITSTATUS(raw))
                                : absl::StrCat("died (status ", raw, ")");
    return absl::InternalError(
        absl::StrCat("`", command, "` ", how, "; stderr:\n", err));
  }
  return out;
}

}  // namespace pdworker::model_testing
