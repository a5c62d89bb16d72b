// Logit masks between the step and the sampler: they set logits to -inf,
// which worker/kernels/sampling.h treats as zero probability, so the sampler
// can never pick those tokens. Both ops run outside graphs: their entry
// counts are host values that change every step.
//
//  - LaunchBanTokens: logits[rows[i], token_ids[i]] = -inf. vLLM's
//    min_tokens: until a request has generated min_tokens tokens, its EOS
//    and stop-token ids are banned in its logits row.
//  - LaunchMaskBelowMax: in row rows[i], every logit below
//    max(row) + offsets[i] becomes -inf. vLLM's min_p: keeping the tokens
//    with p_i >= min_p * p_max under softmax(logits / T) is keeping
//    l_i >= l_max + T * ln(min_p), because p_i / p_max = exp((l_i - l_max) /
//    T); so the mask works on the raw logits (the sampler applies T itself)
//    with a per-row offset T * ln(min_p) <= 0 that the host computes.
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

// Entry i (i < num_rows) masks row r = rows[i] of `logits`: with
// m = max(row), every logit l < m + offsets[i] (that sum in fp32) becomes
// -inf. The max itself always stays (offsets[i] <= 0), so a row keeps at
// least one token, ties at the max included; offsets[i] = 0 keeps only the
// max and its exact ties. NaN logits count as -inf, as in sampling.h: they
// never are the max, and every NaN in a listed row is stored as -inf.
//
// An offset of -inf (min_p = 0) masks nothing. So does an offset that is NaN
// or positive (only a bug upstream produces one; like -inf, it can never
// mask the max). An entry whose row is outside [0, num_logit_rows) is skipped
// (device data the host does not read; never an out-of-bounds access). A
// row listed twice gets the stricter (larger) of its offsets: masking never
// changes a row's max, so each entry masks what it would have masked alone.
// Nothing outside the listed rows is written.
struct MaskBelowMaxParams {
  DeviceBuffer logits;     // fp32 [>= num_logit_rows, vocab_size], in place
  DeviceBuffer rows;       // int32 [>= num_rows]: the logits row of entry i
  DeviceBuffer offsets;    // fp32 [>= num_rows]: T * ln(min_p) of entry i
  int num_rows = 0;        // entries; host value; 0 launches nothing
  int num_logit_rows = 0;  // rows of `logits` (bound for rows[i])
  int vocab_size = 0;
};

// Errors as LaunchBanTokens: FAILED_PRECONDITION while the stream is
// capturing (the capture is invalidated); INVALID_ARGUMENT naming the field
// for a negative count, a non-positive vocab_size, a buffer smaller than its
// shape, or logits overlapping rows / offsets, checked even when num_rows
// is 0.
absl::Status LaunchMaskBelowMax(Stream& stream, const MaskBelowMaxParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_TOKEN_MASK_H_
