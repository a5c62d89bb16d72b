// Runs the independent numpy reference (tests/reference/llama_reference.py,
// float64 internally) from a C++ test and returns its results.
#ifndef PDWORKER_TESTS_MODEL_REFERENCE_RUNNER_H_
#define PDWORKER_TESTS_MODEL_REFERENCE_RUNNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdworker::model_testing {

// Full-causal logits of every position of every sequence: result[s] holds
// sequences[s].size() * vocab floats, row-major [position][token id]; row p
// is the next-token distribution after tokens[0..p]. Each sequence must be
// non-empty. Errors carry the script's stderr.
absl::StatusOr<std::vector<std::vector<float>>> RunReferenceLogits(
    const std::string& model_dir,
    const std::vector<std::vector<int32_t>>& sequences);

// Greedy continuation: `steps` argmax tokens (ties -> lowest id) appended
// after `prompt`, each from a full forward over prompt + tokens so far.
absl::StatusOr<std::vector<int32_t>> RunReferenceGreedy(
    const std::string& model_dir, const std::vector<int32_t>& prompt,
    int steps);

}  // namespace pdworker::model_testing

#endif  // PDWORKER_TESTS_MODEL_REFERENCE_RUNNER_H_
