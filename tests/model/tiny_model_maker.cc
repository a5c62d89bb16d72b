#include "tests/model/tiny_model_maker.h"

#include "absl/strings/str_cat.h"
#include "tests/model/command.h"
#include "tests/model/test_paths.h"

namespace pdworker::model_testing {

absl::StatusOr<std::string> MakeTinyModel(const TinyModelRequest& request) {
  const std::string dir = MakeUniqueTempDir(absl::StrCat(
      "tiny_", request.shape, "_", request.dtype, "_", request.shards));
  const std::string command = absl::StrCat(
      ShellQuote(RunfilePath("tools/make_tiny_model/make_tiny_model")),
      " --out_dir=", ShellQuote(dir), " --shape=", ShellQuote(request.shape),
      " --dtype=", ShellQuote(request.dtype), " --shards=", request.shards,
      " --seed=", request.seed);
  auto output = RunCommand(command);
  if (!output.ok()) return output.status();
  return dir;
}

}  // namespace pdworker::model_testing
