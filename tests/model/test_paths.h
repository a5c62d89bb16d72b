// Where a Bazel test finds its data files and writes scratch files.
#ifndef PDWORKER_TESTS_MODEL_TEST_PATHS_H_
#define PDWORKER_TESTS_MODEL_TEST_PATHS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace pdworker::model_testing {

// Absolute path of a `data` dependency given its workspace-relative path
// (e.g. "tools/make_tiny_model/make_tiny_model"): $TEST_SRCDIR/pdworker/...,
// or $RUNFILES_DIR/pdworker/... outside `bazel test`; the path unchanged when
// neither is set (run from the workspace root).
std::string RunfilePath(absl::string_view workspace_relative);

// A fresh, empty directory under $TEST_TMPDIR (or /tmp), named after `label`
// plus a per-process counter and the pid, so concurrent tests never collide.
std::string MakeUniqueTempDir(absl::string_view label);

// `text` single-quoted for /bin/sh.
std::string ShellQuote(absl::string_view text);

}  // namespace pdworker::model_testing

#endif  // PDWORKER_TESTS_MODEL_TEST_PATHS_H_
