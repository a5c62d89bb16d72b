// Raw logprobs for the request API: per output token, the sampled token's
// log-probability and the top-k alternatives, as log_softmax of the model's
// logits before temperature, top-k/top-p, penalties or masks (vLLM's default
// logprobs_mode "raw_logprobs"). The sampler (worker/kernels/sampling.h)
// reports a processed logprob only.
//
// Both ops run after the forward and outside graphs, for only the logits
// rows whose requests asked for logprobs: num_rows and k are host values
// that change every step. LaunchTopLogprobs runs before the logits are
// masked or sampled from (it reads them as the model wrote them);
// LaunchGatherLogprobs after sampling, with the logsumexp it wrote.
#ifndef PDWORKER_WORKER_KERNELS_LOGPROBS_H_
#define PDWORKER_WORKER_KERNELS_LOGPROBS_H_

#include "absl/status/status.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Most alternatives per token (vLLM's default max_logprobs).
inline constexpr int kMaxTopLogprobs = 20;

// For entry i < num_rows, logits row r = rows[i] (fp32 [vocab_size]); NaN
// logits count as -inf, exactly as in sampling.h:
//  - logsumexp[i] = log(sum_v exp(logits[r, v])) over the whole vocabulary,
//    computed in double with the row's max subtracted and rounded to fp32
//    once. A row of all -inf gives -inf; a row with a +inf logit gives +inf.
//  - top_token_ids[i * k + j], top_logprobs[i * k + j] for j < k: the k
//    largest logits in descending order, ties (equal logits, -0 == +0) to the
//    lower token id, -inf entries last (lowest ids first); the logprob is
//    logit - logsumexp[i] in fp32, or -inf when logsumexp[i] is -inf (and NaN
//    for a +inf logit: inf - inf). The same fp32 subtraction as
//    LaunchGatherLogprobs, so a sampled token listed here gets the same bits.
// An entry whose rows[i] is outside [0, num_logit_rows) gets logsumexp -inf,
// ids -1 and logprobs -inf: the rows are device data the host does not read,
// so such an entry means a bug upstream, and it must never become an
// out-of-bounds read. Nothing but the num_rows (·k) outputs is written.
struct TopLogprobsParams {
  DeviceBuffer logits;         // fp32 [>= num_logit_rows, vocab_size]
  DeviceBuffer rows;           // int32 [>= num_rows]: the logits row of entry i
  DeviceBuffer logsumexp;      // fp32 [>= num_rows], written
  DeviceBuffer top_token_ids;  // int32 [>= num_rows * k], written (k > 0)
  DeviceBuffer top_logprobs;   // fp32 [>= num_rows * k], written (k > 0)
  int num_rows = 0;            // host value; 0 launches nothing
  int num_logit_rows = 0;      // rows of `logits` (bound for rows[i])
  int vocab_size = 0;
  // Host value in [0, min(kMaxTopLogprobs, vocab_size)]; 0: logsumexp only
  // (the top buffers are then not needed).
  int k = 0;
};

// FAILED_PRECONDITION while the stream is capturing (num_rows and k would be
// frozen into the graph), and the capture is invalidated. INVALID_ARGUMENT
// naming the field for a negative count, a non-positive vocab_size, k outside
// its range, a buffer smaller than its shape (or null), or an output
// overlapping an input or another output. The shapes are checked even when
// num_rows is 0.
absl::Status LaunchTopLogprobs(Stream& stream, const TopLogprobsParams& p);

// logprobs[i] = logits[r, token_ids[r]] - logsumexp[i] with r = rows[i]: the
// raw logprob of the token the sampler picked for that row (token_ids is the
// sampler's output, indexed by logits row; the logits may have been masked
// since LaunchTopLogprobs, but never at the sampled token). fp32 subtraction;
// a NaN logit counts as -inf, and logsumexp -inf gives -inf. An entry whose
// row is outside [0, num_logit_rows) or whose token id is outside
// [0, vocab_size) gets -inf (a bug upstream; never an out-of-bounds read).
struct GatherLogprobsParams {
  DeviceBuffer logits;     // fp32 [>= num_logit_rows, vocab_size]
  DeviceBuffer rows;       // int32 [>= num_rows]
  DeviceBuffer token_ids;  // int32 [>= num_logit_rows]: sampled id per row
  DeviceBuffer logsumexp;  // fp32 [>= num_rows], from LaunchTopLogprobs
  DeviceBuffer logprobs;   // fp32 [>= num_rows], written
  int num_rows = 0;        // host value; 0 launches nothing
  int num_logit_rows = 0;  // rows of `logits` and `token_ids`
  int vocab_size = 0;
};

// The same errors as LaunchTopLogprobs (logprobs must not overlap any
// input).
absl::Status LaunchGatherLogprobs(Stream& stream,
                                  const GatherLogprobsParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LOGPROBS_H_
