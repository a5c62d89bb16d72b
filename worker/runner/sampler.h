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
  uint64_t seed = 0;         // RNG stream; with position, fixes the draw
};

// INVALID_ARGUMENT naming the field for NaN, negative or out-of-range values.
absl::Status ValidateSamplingOptions(const SamplingOptions& options);

struct SampledToken {
  int32_t token_id = -1;
  float logprob = 0.0f;  // of the sampled token, after temperature
};

class Sampler {
 public:
  // `workspace_bytes`: kernels::SamplingWorkspaceBytesFor(the arena's
  // device kind, vocab_size, max_num_seqs).
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(
      Arena& arena, int max_num_seqs, int vocab_size, size_t workspace_bytes);

  // Samples rows [0, options.size()) of `logits` ([rows, vocab] fp32).
  // `positions[r]` is the absolute position of request r's sampled token (its
  // length after the step): the RNG counter, so a sequence's draws do not
  // depend on which batch it ran in. Not during capture. Writes `out`.
  absl::Status Sample(Stream& stream, DeviceBuffer logits,
                      absl::Span<const SamplingOptions> options,
                      absl::Span<const int32_t> positions,
                      std::vector<SampledToken>* out);

 private:
  Sampler(int max_num_seqs, int vocab_size);

  int max_num_seqs_;
  int vocab_size_;
  DeviceBuffer temperature_, top_k_, top_p_, seeds_, positions_, workspace_,
      token_ids_, logprobs_;
  // Host staging, sized at startup.
  std::vector<float> h_temperature_, h_top_p_, h_logprobs_;
  std::vector<int32_t> h_top_k_, h_positions_, h_token_ids_;
  std::vector<uint64_t> h_seeds_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_SAMPLER_H_
