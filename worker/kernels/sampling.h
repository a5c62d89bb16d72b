// Token sampling from the lm_head logits: greedy, temperature, top-k, top-p,
// with a counter-based RNG so that a request's draws depend only on its own
// (seed, position), never on which other requests share the batch or on
// their order.
//
// Runs after the step, outside graphs: num_reqs is a host value (the real
// requests, never the padded count). The per-request parameters are still
// read from device buffers, so the CUDA version can sample without a host
// round trip.
#ifndef PDWORKER_WORKER_KERNELS_SAMPLING_H_
#define PDWORKER_WORKER_KERNELS_SAMPLING_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by a
// tinier temperature would overflow the scaled logits.
inline constexpr float kGreedyTemperature = 1e-5f;

// What sampled_logprobs reports for the sampled token.
enum class LogprobMode {
  // log p(token) under the distribution the token was actually drawn from:
  // softmax(logits / temperature) restricted to the top-k ∩ top-p set and
  // renormalized. Greedy requests use temperature 1 (then the value is the
  // argmax's log-probability within that set). This is the default: it is
  // what a caller checking "how likely was this draw" needs.
  kProcessed,
  // log_softmax(logits)[token] over the whole vocabulary, before temperature
  // and truncation (vLLM's "raw_logprobs"; the model's own belief).
  kRaw,
};

// How LaunchSampling picks. kGeneral: per row, as below. kGreedy: every row
// greedy over the whole vocabulary — the token is the argmax (ties to the
// lowest id) and its logprob is log_softmax(logits)[token], which is what
// kGeneral gives a greedy row without top-k / top-p in either LogprobMode.
// temperature, top_k, top_p, seeds and positions are not read (they may be
// empty), nor is the workspace on the CPU (on CUDA it holds each row's 64
// slice results: SamplingWorkspaceBytesFor covers them). One pass over the
// logits, no sort and, on CUDA, no host round trip and no double precision
// (fp32 log-sum-exp: the logprob within ~1e-6 of kGeneral's); a row's
// result does not depend on the other rows of the batch. The caller (the
// runner's Sampler) takes it when every request of the step is greedy and
// untruncated.
enum class SamplingPath { kGeneral, kGreedy };

// Per request r < num_reqs (row r of every buffer):
//  - temperature[r] < kGreedyTemperature (or NaN): greedy, argmax of the
//    logits, ties to the lowest token id; top_k/top_p do not change the token.
//  - otherwise p ∝ exp(logits / temperature); top_k[r] > 0 keeps the k most
//    likely tokens (ties to lower ids); then top_p[r] < 1 keeps the shortest
//    most-likely-first prefix whose probability reaches top_p (at least one
//    token; top_p <= 0 keeps exactly one); the token is drawn by inverse CDF
//    with u = Uniform(seed[r], position[r]) in [0, 1).
// NaN logits count as −inf. A row whose logits are all −inf yields token 0
// with logprob −inf.
struct SamplingParams {
  DeviceBuffer logits;       // fp32 [>= num_reqs, vocab_size]
  DeviceBuffer temperature;  // fp32 [>= num_reqs]
  DeviceBuffer top_k;        // int32 [>= num_reqs]; 0 (or >= vocab): off
  DeviceBuffer top_p;        // fp32 [>= num_reqs]; >= 1 (or NaN): off
  // uint64 [>= num_reqs]: the request's seed; the runner draws one at
  // admission for requests that did not specify it.
  DeviceBuffer seeds;
  // int32 [>= num_reqs]: the RNG counter, distinct for every token a request
  // samples; use the absolute position of the token being sampled (the
  // request's seq_len after this step).
  DeviceBuffer positions;
  // >= SamplingWorkspaceBytesFor(backend, vocab_size, num_reqs) bytes of
  // scratch, allocated once at startup (CPU: sort order and weights of one
  // row; CUDA: sort buffers for a group of rows, the list of rows that
  // truncate, and cub's scratch, or the greedy path's slice results).
  DeviceBuffer workspace;
  DeviceBuffer sampled_token_ids;  // int32 [>= num_reqs], written
  DeviceBuffer sampled_logprobs;   // fp32 [>= num_reqs], written
  int num_reqs = 0;
  int vocab_size = 0;
  LogprobMode logprob_mode = LogprobMode::kProcessed;
  SamplingPath path = SamplingPath::kGeneral;
  // kGeneral on CUDA: how many rows use top-k or top-p
  // (SamplingRowTruncates of their host values), which sizes the sort
  // passes. -1: counted on the device and read back, a stream
  // synchronization that makes the host wait for everything enqueued
  // before (the whole forward). The runner knows the options and passes
  // the count. Must be in [-1, num_reqs] and, when >= 0, exact.
  int num_truncated_rows = -1;
  // kGreedy on CUDA, or empty: GreedyTilesBytes(num_reqs) bytes, the tile
  // folds an LM head wrote together with these logits
  // (LmHeadParams::greedy_tiles), nothing having changed the logits since
  // (no bans, no masks). Then only the combine kernel runs and the logits
  // are not read; the token and logprob carry the same bits either way.
  // Refused on the CPU backend and with kGeneral.
  DeviceBuffer greedy_tiles;
};

// Bytes of the greedy tile folds of `num_rows` rows on CUDA (512 per row,
// 12 bytes each; greedy_fold.cuh); 0 in a binary built without CUDA.
size_t GreedyTilesBytes(int num_rows);

// Whether a row with these options takes the sorted (top-k / top-p) path:
// top_k in (0, vocab_size), or top_p < 1 (NaN: off). The device applies the
// same test to the values in the buffers.
inline bool SamplingRowTruncates(int32_t top_k, float top_p, int vocab_size) {
  return (top_k > 0 && top_k < vocab_size) || top_p < 1.0f;
}

// The CPU kernel's workspace.
size_t SamplingWorkspaceBytes(int vocab_size);

// The workspace of the kernel that runs on `kind`, for launches of up to
// `max_num_reqs` rows (the CPU kernel's does not depend on it). On CUDA this
// asks cub for its sort scratch, which needs a usable GPU
// (UNAVAILABLE/INTERNAL otherwise); UNIMPLEMENTED in a binary built without
// CUDA.
absl::StatusOr<size_t> SamplingWorkspaceBytesFor(DeviceKind kind,
                                                 int vocab_size,
                                                 int max_num_reqs);

// The uniform draw in [0, 1) for (seed, position): splitmix64 of the seed
// selects a stream and the position indexes it (53 random bits). Exposed for
// tests and for tools that replay a sampling decision.
double SamplingUniform(uint64_t seed, int32_t position);

// FAILED_PRECONDITION while the stream is capturing (sampling is never part
// of a graph: num_reqs would be frozen), and the capture is invalidated.
// The CUDA kernel makes the same decisions with the same RNG: given equal
// logits both backends sample the same token, except when u·total lies
// within ~1e-15 (relative) of a CDF boundary, where the different summation
// order of the double sums can tip it (see sampling.cu).
absl::Status LaunchSampling(Stream& stream, const SamplingParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SAMPLING_H_
