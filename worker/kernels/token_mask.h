// Token bans in the logits: logits[rows[i], token_ids[i]] = -inf.
//
// vLLM's min_tokens: until a request has generated min_tokens tokens, its EOS
// and stop-token ids are banned in its logits row, so the sampler
// (worker/kernels/sampling.h treats -inf as zero probability) can never pick
// them. Runs after the step and before sampling, outside graphs: num_bans is
// a host value that changes every step.
#ifndef PDWORKER_WORKER_KERNELS_TOKEN_MASK_H_
#define PDWORKER_WORKER_KERNELS_TOKEN_MASK_H_

#include "absl/status/status.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Ban i (i < num_bans) sets logits[rows[i] * vocab_size + token_ids[i]] to
// -inf. The same (row, token) listed twice is banned once (both writes store
// -inf). A ban whose row is outside [0, num_rows) or whose token id is outside
// [0, vocab_size) is skipped: the buffers are device data the host does not
// read, so such an entry means a bug upstream, and it must never become an
// out-of-bounds write. Nothing but the banned logits is written.
struct BanTokensParams {
  DeviceBuffer logits;     // fp32 [>= num_rows, vocab_size], modified in place
  DeviceBuffer rows;       // int32 [>= num_bans]: the logits row of ban i
  DeviceBuffer token_ids;  // int32 [>= num_bans]: the token id of ban i
  int num_bans = 0;        // host value; 0 launches nothing
  int num_rows = 0;        // rows of `logits` (bound for rows[i])
  int vocab_size = 0;
};

// FAILED_PRECONDITION while the stream is capturing (num_bans would be frozen
// into the graph), and the capture is invalidated. INVALID_ARGUMENT naming
// the field for a negative count, a non-positive vocab_size, a buffer smaller
// than its shape, or logits overlapping rows / token_ids. The shapes are
// checked even when num_bans is 0 (a wrong logits view is a bug whether or
// not this step bans anything).
absl::Status LaunchBanTokens(Stream& stream, const BanTokensParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_TOKEN_MASK_H_
