// Sampler: per-request sampling parameters in static buffers, the sampling
// launch after the forward, and the read-back of tokens and logprobs.
#ifndef PDWORKER_WORKER_RUNNER_SAMPLER_H_
#define PDWORKER_WORKER_RUNNER_SAMPLER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

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

// One step's sampling, row r < options.size() of the logits.
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
};

class Sampler {
 public:
  // `workspace_bytes`: kernels::SamplingWorkspaceBytesFor(the arena's
  // device kind, vocab_size, max_num_seqs). `max_bans`: bans per step at
  // most.
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(Arena& arena,
                                                         int max_num_seqs,
                                                         int vocab_size,
                                                         size_t workspace_bytes,
                                                         int max_bans);

  // Enqueues the bans on `logits` ([rows, vocab] fp32), then sampling of
  // rows [0, batch.options.size()) into `token_ids` (int32) and `logprobs`
  // (fp32), device buffers of >= that many elements. Returns without
  // waiting (the host reads the results through its own copy). Not during
  // capture. INVALID_ARGUMENT for a batch outside the limits.
  absl::Status Launch(Stream& stream, DeviceBuffer logits,
                      const SamplingBatch& batch, DeviceBuffer token_ids,
                      DeviceBuffer logprobs);

  int max_bans() const { return max_bans_; }

 private:
  Sampler(int max_num_seqs, int vocab_size, int max_bans);

  int max_num_seqs_;
  int vocab_size_;
  int max_bans_;
  DeviceBuffer temperature_, top_k_, top_p_, seeds_, positions_, workspace_,
      ban_rows_, ban_token_ids_, min_p_rows_, min_p_offsets_;
  // Host staging, sized at startup.
  std::vector<float> h_temperature_, h_top_p_, h_min_p_offsets_;
  std::vector<int32_t> h_top_k_, h_positions_, h_min_p_rows_;
  std::vector<uint64_t> h_seeds_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_SAMPLER_H_
