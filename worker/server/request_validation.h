// Stateless checks of Forward and Release requests, done on the gRPC thread
// before anything is queued: a request that fails here never reaches the
// engine. What needs the worker's state (unknown or live sequence ids, a
// sequence growing past max_model_len, a full KV cache) is checked by the
// model runner, which changes nothing when it refuses.
#ifndef PDWORKER_WORKER_SERVER_REQUEST_VALIDATION_H_
#define PDWORKER_WORKER_SERVER_REQUEST_VALIDATION_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/worker.pb.h"
#include "worker/engine/step_calls.h"
#include "worker/runner/model_runner.h"

namespace pdworker {

// SequenceInput.sequence_id is 1..128 bytes (proto/worker.proto).
inline constexpr size_t kMaxSequenceIdBytes = 128;

// What a request is checked against (the worker's flags and the model).
struct RequestLimits {
  int max_num_seqs = 0;   // sequences per call
  int vocab_size = 0;     // token ids in [0, vocab_size)
  int max_model_len = 0;  // tokens per sequence
  // SequenceInput.num_samples at most: the runner's
  // uniform_decode_query_len (1 + num_speculative_tokens).
  int max_num_samples = 1;
};

// INVALID_ARGUMENT naming the field (e.g. "sequences[2].token_ids[5]=999 is
// outside the vocabulary [0, 256)") for: no sequences, more than
// max_num_seqs, an empty, oversized or repeated sequence_id, no token_ids, a
// token outside the vocabulary, more tokens than max_model_len, NaN or
// out-of-range sampling values, hold_for_handoff together with
// release_after_step, num_samples outside [0, min(token_ids,
// max_num_samples)]. Checks run in field order; the first failure
// is reported.
absl::StatusOr<ForwardCallSpec> ValidateForwardRequest(
    const v1::ForwardRequest& request, const RequestLimits& limits);

// The ids to free: INVALID_ARGUMENT for an empty list or an empty,
// oversized or repeated id.
absl::StatusOr<std::vector<std::string>> ValidateReleaseRequest(
    const v1::ReleaseRequest& request);

// INVALID_ARGUMENT naming `field` for an empty id, one longer than
// kMaxSequenceIdBytes, or one beginning with kEngineSequencePrefix.
absl::Status CheckSequenceId(absl::string_view field, absl::string_view id);

// The sampling seed of a sequence that sets none: a 64-bit FNV-1a hash of
// its id, stable across processes, restarts and machines, so re-running a
// request reproduces its tokens.
uint64_t DefaultSeed(absl::string_view sequence_id);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_REQUEST_VALIDATION_H_
