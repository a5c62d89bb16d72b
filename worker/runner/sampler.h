// Sampler: per-request sampling parameters in static buffers, the sampling
// launch after the forward, and the read-back of tokens and logprobs.
#ifndef PDWORKER_WORKER_RUNNER_SAMPLER_H_
#define PDWORKER_WORKER_RUNNER_SAMPLER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {

// What a request asks of sampling. The defaults are greedy decoding.
struct SamplingOptions {
  float temperature = 0.0f;  // 0: greedy (argmax); otherwise > 0
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off; in (0, 1]
  // 0: off; in [0, 1]. Keeps the tokens at least this times as likely as
  // the most likely one (after temperature), before top-k/top-p, as vLLM's
  // min_p. No effect on greedy rows.
  float min_p = 0.0f;
  uint64_t seed = 0;  // RNG stream; with position, fixes the draw
};

// INVALID_ARGUMENT naming the field for NaN, negative or out-of-range values.
absl::Status ValidateSamplingOptions(const SamplingOptions& options);

// One step's sampling, row r < options.size() of the logits (a sequence
// that verifies drafts has several rows, each with its options).
struct SamplingBatch {
  absl::Span<const SamplingOptions> options;
  // positions[r]: the absolute position of row r's sampled token (its
  // sequence's length after the step): the RNG counter, so a sequence's
  // draws do not depend on which batch it ran in.
  absl::Span<const int32_t> positions;
  // Ban i: token banned_token_ids[i] may not be sampled in row
  // banned_rows[i] (its logit becomes -inf first). A request's min_tokens.
  absl::Span<const int32_t> banned_rows;
  absl::Span<const int32_t> banned_token_ids;
  // The tile folds the LM head wrote with these logits
  // (LlamaForward::GreedyTiles), or empty. Used when every row is greedy
  // and nothing is banned: the sampler then skips its pass over the logits
  // (same bits).
  DeviceBuffer greedy_tiles;
};

// Sampler's sizes, fixed at startup.
struct SamplerLimits {
  int max_num_rows = 0;  // logits rows per step
  int vocab_size = 0;
  // kernels::SamplingWorkspaceBytesFor(the device kind, vocab_size,
  // max_num_rows).
  size_t workspace_bytes = 0;
  int max_bans = 0;  // bans per step at most
  // Steps whose parameters may be uploaded but not yet copied by the
  // device: each has its own pinned block (UploadRing).
  int max_uploads_in_flight = 1;
};

class Sampler {
 public:
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(
      Device& device, Arena& arena, const SamplerLimits& limits);

  // Enqueues the bans on `logits` ([rows, vocab] fp32), then sampling of
  // rows [0, batch.options.size()) into `token_ids` (int32) and `logprobs`
  // (fp32), device buffers of >= that many elements. The per-request
  // parameters, bans and min_p rows the step needs go up in one copy from a
  // pinned block (none when every row is greedy and nothing is banned).
  // Returns without waiting (the host reads the results through its own
  // copy). Not during capture. INVALID_ARGUMENT for a batch outside the
  // limits.
  absl::Status Launch(Stream& stream, DeviceBuffer logits,
                      const SamplingBatch& batch, DeviceBuffer token_ids,
                      DeviceBuffer logprobs);

  int max_bans() const { return limits_.max_bans; }

 private:
  Sampler(const SamplerLimits& limits, DeviceBuffer params,
          DeviceBuffer workspace, std::unique_ptr<UploadRing> ring);

  SamplerLimits limits_;
  // Where a step's packed parameters land (seeds, temperature, top_k,
  // top_p, positions, min_p rows and offsets, ban rows and ids, each as
  // long as the step needs), and the sampling kernels' scratch.
  DeviceBuffer params_, workspace_;
  std::unique_ptr<UploadRing> ring_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_SAMPLER_H_
