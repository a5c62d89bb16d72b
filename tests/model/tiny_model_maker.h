// Runs the make_tiny_model binary (a `data` dependency) from a test.
#ifndef PDWORKER_TESTS_MODEL_TINY_MODEL_MAKER_H_
#define PDWORKER_TESTS_MODEL_TINY_MODEL_MAKER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pdworker::model_testing {

struct TinyModelRequest {
  std::string shape = "gqa";  // make_tiny_model --shape (not "all")
  std::string dtype = "float32";
  int shards = 1;
  uint64_t seed = 0;
};

// Writes the model into a fresh directory under $TEST_TMPDIR and returns its
// path. The error carries the binary's exit status and stderr.
absl::StatusOr<std::string> MakeTinyModel(const TinyModelRequest& request);

}  // namespace pdworker::model_testing

#endif  // PDWORKER_TESTS_MODEL_TINY_MODEL_MAKER_H_
