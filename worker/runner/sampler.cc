#include "worker/runner/sampler.h"

#include <cmath>
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

Sampler::Sampler(int max_num_seqs, int vocab_size, int max_bans)
    : max_num_seqs_(max_num_seqs),
      vocab_size_(vocab_size),
      max_bans_(max_bans),
      h_temperature_(max_num_seqs),
      h_top_p_(max_num_seqs),
      h_min_p_offsets_(max_num_seqs),
      h_top_k_(max_num_seqs),
      h_positions_(max_num_seqs),
      h_min_p_rows_(max_num_seqs),
      h_seeds_(max_num_seqs) {}

absl::StatusOr<std::unique_ptr<Sampler>> Sampler::Create(Arena& arena,
                                                         int max_num_seqs,
                                                         int vocab_size,
                                                         size_t workspace_bytes,
                                                         int max_bans) {
  if (max_num_seqs <= 0 || vocab_size <= 0 || max_bans <= 0) {
    return absl::InvalidArgumentError(
        "Sampler: max_num_seqs, vocab_size and max_bans must be positive");
  }
  std::unique_ptr<Sampler> s(new Sampler(max_num_seqs, vocab_size, max_bans));
  const size_t n = static_cast<size_t>(max_num_seqs);
  const size_t bans = static_cast<size_t>(max_bans);
  PDW_ASSIGN_OR_RETURN(s->temperature_,
                       arena.Allocate(n * sizeof(float), "temperature"));
  PDW_ASSIGN_OR_RETURN(s->top_k_, arena.Allocate(n * sizeof(int32_t), "top_k"));
  PDW_ASSIGN_OR_RETURN(s->top_p_, arena.Allocate(n * sizeof(float), "top_p"));
  PDW_ASSIGN_OR_RETURN(s->seeds_,
                       arena.Allocate(n * sizeof(uint64_t), "seeds"));
  PDW_ASSIGN_OR_RETURN(s->positions_,
                       arena.Allocate(n * sizeof(int32_t), "sample_positions"));
  PDW_ASSIGN_OR_RETURN(s->workspace_,
                       arena.Allocate(workspace_bytes, "sampling_workspace"));
  PDW_ASSIGN_OR_RETURN(s->ban_rows_,
                       arena.Allocate(bans * sizeof(int32_t), "ban_rows"));
  PDW_ASSIGN_OR_RETURN(s->ban_token_ids_,
                       arena.Allocate(bans * sizeof(int32_t), "ban_token_ids"));
  PDW_ASSIGN_OR_RETURN(s->min_p_rows_,
                       arena.Allocate(n * sizeof(int32_t), "min_p_rows"));
  PDW_ASSIGN_OR_RETURN(s->min_p_offsets_,
                       arena.Allocate(n * sizeof(float), "min_p_offsets"));
  return s;
}

absl::Status Sampler::Launch(Stream& stream, DeviceBuffer logits,
                             const SamplingBatch& batch, DeviceBuffer token_ids,
                             DeviceBuffer logprobs) {
  const int n = static_cast<int>(batch.options.size());
  if (n <= 0 || n > max_num_seqs_ ||
      batch.positions.size() != batch.options.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: ", n, " requests outside [1, ", max_num_seqs_,
                     "] or positions mismatch"));
  }
  const int num_bans = static_cast<int>(batch.banned_rows.size());
  if (batch.banned_token_ids.size() != batch.banned_rows.size() ||
      num_bans > max_bans_) {
    return absl::InvalidArgumentError(
        absl::StrCat("Sampler: ", num_bans,
                     " banned tokens in one step; at most ", max_bans_));
  }
  // Every request greedy and untruncated (top-k and top-p change a greedy
  // row's processed logprob): the one-pass greedy kernel, which reads only
  // the logits, so the per-request options are not even uploaded.
  bool all_greedy = true;
  for (int r = 0; r < n && all_greedy; ++r) {
    const SamplingOptions& o = batch.options[r];
    all_greedy = !(o.temperature >= kernels::kGreedyTemperature) &&
                 !(o.top_k > 0 && o.top_k < vocab_size_) &&
                 !(o.top_p < 1.0f);  // NaN: off, as the kernels read it
  }
  if (!all_greedy) {
    for (int r = 0; r < n; ++r) {
      h_temperature_[r] = batch.options[r].temperature;
      h_top_k_[r] = batch.options[r].top_k;
      h_top_p_[r] = batch.options[r].top_p;
      h_seeds_[r] = batch.options[r].seed;
      h_positions_[r] = batch.positions[r];
    }
    const size_t f = n * sizeof(float), i = n * sizeof(int32_t);
    PDW_RETURN_IF_ERROR(
        stream.CopyToDevice(temperature_, h_temperature_.data(), f));
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(top_k_, h_top_k_.data(), i));
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(top_p_, h_top_p_.data(), f));
    PDW_RETURN_IF_ERROR(
        stream.CopyToDevice(seeds_, h_seeds_.data(), n * sizeof(uint64_t)));
    PDW_RETURN_IF_ERROR(
        stream.CopyToDevice(positions_, h_positions_.data(), i));
  }

  if (num_bans > 0) {
    const size_t b = num_bans * sizeof(int32_t);
    PDW_RETURN_IF_ERROR(
        stream.CopyToDevice(ban_rows_, batch.banned_rows.data(), b));
    PDW_RETURN_IF_ERROR(
        stream.CopyToDevice(ban_token_ids_, batch.banned_token_ids.data(), b));
    kernels::BanTokensParams bp;
    bp.logits = logits;
    bp.rows = ban_rows_;
    bp.token_ids = ban_token_ids_;
    bp.num_bans = num_bans;
    bp.num_rows = n;
    bp.vocab_size = vocab_size_;
    PDW_RETURN_IF_ERROR(kernels::LaunchBanTokens(stream, bp));
  }

  // min_p: mask, in the raw logits, what falls below the row's max by
  // more than T * ln(min_p) (the sampler divides by T afterwards).
  int num_min_p = 0;
  for (int r = 0; r < n; ++r) {
    const SamplingOptions& o = batch.options[r];
    if (o.min_p <= 0.0f || !(o.temperature >= kernels::kGreedyTemperature)) {
      continue;
    }
    h_min_p_rows_[num_min_p] = r;
    h_min_p_offsets_[num_min_p] = static_cast<float>(
        static_cast<double>(o.temperature) * std::log(double{o.min_p}));
    ++num_min_p;
  }
  if (num_min_p > 0) {
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(min_p_rows_, h_min_p_rows_.data(),
                                            num_min_p * sizeof(int32_t)));
    PDW_RETURN_IF_ERROR(stream.CopyToDevice(
        min_p_offsets_, h_min_p_offsets_.data(), num_min_p * sizeof(float)));
    kernels::MaskBelowMaxParams mp;
    mp.logits = logits;
    mp.rows = min_p_rows_;
    mp.offsets = min_p_offsets_;
    mp.num_rows = num_min_p;
    mp.num_logit_rows = n;
    mp.vocab_size = vocab_size_;
    PDW_RETURN_IF_ERROR(kernels::LaunchMaskBelowMax(stream, mp));
  }

  kernels::SamplingParams p;
  p.logits = logits;
  p.temperature = temperature_;
  p.top_k = top_k_;
  p.top_p = top_p_;
  p.seeds = seeds_;
  p.positions = positions_;
  p.workspace = workspace_;
  p.sampled_token_ids = token_ids;
  p.sampled_logprobs = logprobs;
  p.num_reqs = n;
  p.vocab_size = vocab_size_;
  p.path = all_greedy ? kernels::SamplingPath::kGreedy
                      : kernels::SamplingPath::kGeneral;
  return kernels::LaunchSampling(stream, p);
}

}  // namespace pdworker
