#include "tests/model/test_paths.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "glog/logging.h"

namespace pdworker::model_testing {

std::string RunfilePath(absl::string_view workspace_relative) {
  for (const char* variable : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* root = std::getenv(variable);
    if (root != nullptr && root[0] != '\0') {
      return absl::StrCat(root, "/pdworker/", workspace_relative);
    }
  }
  return absl::StrCat(workspace_relative);
}

std::string MakeUniqueTempDir(absl::string_view label) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root = tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp";
  std::string dir = absl::StrCat(root, "/", label, "_", ::getpid(), "_",
                                 counter.fetch_add(1));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  CHECK(std::filesystem::is_directory(dir)) << "cannot create " << dir;
  return dir;
}

std::string ShellQuote(absl::string_view text) {
  return absl::StrCat("'", absl::StrReplaceAll(text, {{"'", "'\\''"}}), "'");
}

}  // namespace pdworker::model_testing
