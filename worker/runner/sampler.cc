#include "worker/runner/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/sampling.h"
#include "worker/kernels/token_mask.h"

namespace pdworker {

absl::Status ValidateSamplingOptions(const SamplingOptions& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be a finite number >= 0, got ",
                     o.temperature));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_k must be >= 0 (0 = off), got ", o.top_k));
  }
  if (!std::isfinite(o.top_p) || o.top_p <= 0.0f || o.top_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.top_p must be in (0, 1] (1 = off), got ", o.top_p));
  }
  if (!std::isfinite(o.min_p) || o.min_p < 0.0f || o.min_p > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.min_p must be in [0, 1] (0 = off), got ", o.min_p));
  }
  return absl::OkStatus();
}

namespace {

// Bytes of a step's packed parameters for n rows, m min_p rows and b bans:
// seeds (8-byte) first, then the 4-byte arrays, so every segment is aligned.
size_t PackedParamBytes(int n, int m, int b) {
  return static_cast<size_t>(n) * (sizeof(uint64_t) + 4 * sizeof(int32_t)) +
         static_cast<size_t>(m) * 2 * sizeof(int32_t) +
         static_cast<size_t>(b) * 2 * sizeof(int32_t);
}

// Carves consecutive segments of a pinned block and, at the same offsets,
// of its device copy.
class PackedParams {
 public:
  PackedParams(void* host, DeviceBuffer device)
      : host_(static_cast<char*>(host)), device_(device) {}
  // The next segment of `n` Ts: where the host writes it, and its device
  // view.
  template <typename T>
  std::pair<T*, DeviceBuffer> Take(int n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(T);
    std::pair<T*, DeviceBuffer> segment{reinterpret_cast<T*>(host_ + used_),
                                        device_.Slice(used_, bytes)};
    used_ += bytes;
    return segment;
  }
  size_t used() const { return used_; }

 private:
  char* host_;
  DeviceBuffer device_;
  size_t used_ = 0;
};

}  // namespace

Sampler::Sampler(const SamplerLimits& limits, DeviceBuffer params,
                 DeviceBuffer workspace, std::unique_ptr<UploadRing> ring)
    : limits_(limits),
      params_(params),
      workspace_(workspace),
      ring_(std::move(ring)) {}

absl::StatusOr<std::unique_ptr<Sampler>> Sampler::Create(
    Device& device, Arena& arena, const SamplerLimits& limits) {
  if (limits.max_num_rows <= 0 || limits.vocab_size <= 0 ||
      limits.max_bans <= 0 || limits.max_uploads_in_flight <= 0) {
    return absl::InvalidArgumentError(
        "Sampler: max_num_rows, vocab_size, max_bans and "
        "max_uploads_in_flight must be positive");
  }
  const size_t bytes = PackedParamBytes(limits.max_num_rows,
                                        limits.max_num_rows, limits.max_bans);
  PDW_ASSIGN_OR_RETURN(DeviceBuffer params,
                       arena.Allocate(bytes, "sampling_params"));
  PDW_ASSIGN_OR_RETURN(
      DeviceBuffer workspace,
      arena.Allocate(limits.workspace_bytes, "sampling_workspace"));
  PDW_ASSIGN_OR_RETURN(
      std::unique_ptr<UploadRing> ring,
      UploadRing::Create(device, bytes, limits.max_uploads_in_flight));
  return std::unique_ptr<Sampler>(
      new Sampler(limits, params, workspace, std::move(ring)));
}

absl::Status Sampler::Launch(Stream& stream, DeviceBuffer logits,
                             const SamplingBatch& batch, DeviceBuffer token_ids,
                             DeviceBuffer logprobs) {
  const int n = static_cast<int>(batch.options.size());
  const int vocab_size = limits_.vocab_size;
  if (n <= 0 || n > limits_.max_num_rows ||
      batch.positions.size() != batch.options.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: ", n, " rows outside [1, ", limits_.max_num_rows,
                     "] or positions mismatch"));
  }
  const int num_bans = static_cast<int>(batch.banned_rows.size());
  if (batch.banned_token_ids.size() != batch.banned_rows.size() ||
      num_bans > limits_.max_bans) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: ", num_bans,
                     " banned tokens in one step; at most ", limits_.max_bans));
  }
  // Every request greedy and untruncated (top-k and top-p change a greedy
  // row's processed logprob): the one-pass greedy kernel, which reads only
  // the logits, so the per-request options are not even uploaded.
  bool all_greedy = true;
  for (int r = 0; r < n && all_greedy; ++r) {
    const SamplingOptions& o = batch.options[r];
    all_greedy = !(o.temperature >= kernels::kGreedyTemperature) &&
                 !kernels::SamplingRowTruncates(o.top_k, o.top_p, vocab_size);
  }
  // min_p: mask, in the raw logits, what falls below the row's max by
  // more than T * ln(min_p) (the sampler divides by T afterwards).
  int num_min_p = 0;
  for (const SamplingOptions& o : batch.options) {
    num_min_p += o.min_p > 0.0f && o.temperature >= kernels::kGreedyTemperature;
  }

  kernels::SamplingParams p;
  p.logits = logits;
  p.workspace = workspace_;
  p.sampled_token_ids = token_ids;
  p.sampled_logprobs = logprobs;
  p.num_reqs = n;
  p.vocab_size = vocab_size;
  p.path = all_greedy ? kernels::SamplingPath::kGreedy
                      : kernels::SamplingPath::kGeneral;
  // A ban changes the logits after the head folded them.
  if (all_greedy && num_bans == 0) p.greedy_tiles = batch.greedy_tiles;
  // The sort passes' size from the options here, so the CUDA kernel does
  // not read it back (which would make this call wait for the forward).
  p.num_truncated_rows = 0;
  for (const SamplingOptions& o : batch.options) {
    p.num_truncated_rows +=
        kernels::SamplingRowTruncates(o.top_k, o.top_p, vocab_size);
  }
  kernels::BanTokensParams bp;
  kernels::MaskBelowMaxParams mp;
  const int rows = all_greedy ? 0 : n;
  if (rows + num_min_p + num_bans > 0) {
    // One pinned block, one copy: what the step needs, packed.
    PDW_ASSIGN_OR_RETURN(void* host, ring_->Next());
    PackedParams packed(host, params_);
    auto [seeds, seeds_d] = packed.Take<uint64_t>(rows);
    auto [temperature, temperature_d] = packed.Take<float>(rows);
    auto [top_k, top_k_d] = packed.Take<int32_t>(rows);
    auto [top_p, top_p_d] = packed.Take<float>(rows);
    auto [positions, positions_d] = packed.Take<int32_t>(rows);
    for (int r = 0; r < rows; ++r) {
      const SamplingOptions& o = batch.options[r];
      seeds[r] = o.seed;
      temperature[r] = o.temperature;
      top_k[r] = o.top_k;
      top_p[r] = o.top_p;
      positions[r] = batch.positions[r];
    }
    p.seeds = seeds_d;
    p.temperature = temperature_d;
    p.top_k = top_k_d;
    p.top_p = top_p_d;
    p.positions = positions_d;
    auto [min_p_rows, min_p_rows_d] = packed.Take<int32_t>(num_min_p);
    auto [min_p_offsets, min_p_offsets_d] = packed.Take<float>(num_min_p);
    int m = 0;
    for (int r = 0; r < n; ++r) {
      const SamplingOptions& o = batch.options[r];
      if (o.min_p <= 0.0f || !(o.temperature >= kernels::kGreedyTemperature)) {
        continue;
      }
      min_p_rows[m] = r;
      min_p_offsets[m] = static_cast<float>(static_cast<double>(o.temperature) *
                                            std::log(double{o.min_p}));
      ++m;
    }
    auto [ban_rows, ban_rows_d] = packed.Take<int32_t>(num_bans);
    auto [ban_ids, ban_ids_d] = packed.Take<int32_t>(num_bans);
    std::copy(batch.banned_rows.begin(), batch.banned_rows.end(), ban_rows);
    std::copy(batch.banned_token_ids.begin(), batch.banned_token_ids.end(),
              ban_ids);
    PDW_RETURN_IF_ERROR(ring_->Upload(stream, params_, packed.used()));
    bp.rows = ban_rows_d;
    bp.token_ids = ban_ids_d;
    mp.rows = min_p_rows_d;
    mp.offsets = min_p_offsets_d;
  }

  if (num_bans > 0) {
    bp.logits = logits;
    bp.num_bans = num_bans;
    bp.num_rows = n;
    bp.vocab_size = vocab_size;
    PDW_RETURN_IF_ERROR(kernels::LaunchBanTokens(stream, bp));
  }
  if (num_min_p > 0) {
    mp.logits = logits;
    mp.num_rows = num_min_p;
    mp.num_logit_rows = n;
    mp.vocab_size = vocab_size;
    PDW_RETURN_IF_ERROR(kernels::LaunchMaskBelowMax(stream, mp));
  }
  return kernels::LaunchSampling(stream, p);
}

}  // namespace pdworker
