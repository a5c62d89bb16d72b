#include "worker/server/request_validation.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/fnv1a.h"
#include "common/token_ids.h"
#include "worker/engine/engine.h"
#include "worker/runner/sampler.h"

namespace pdworker {
absl::Status CheckSequenceId(absl::string_view field, absl::string_view id) {
  if (id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  if (id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", id.size(),
                                                   " bytes; the limit is ",
                                                   kMaxSequenceIdBytes));
  }
  if (id[0] == kEngineSequencePrefix) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     " begins with byte 0x01, which the worker reserves for "
                     "the sequences of its own requests"));
  }
  return absl::OkStatus();
}

namespace {

// `prefix` is "sequences[i].sampling".
absl::StatusOr<SamplingOptions> ToSamplingOptions(
    const std::string& prefix, const v1::SamplingParams& p,
    absl::string_view sequence_id) {
  if (!std::isfinite(p.temperature()) || p.temperature() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".temperature=", p.temperature(),
                     " must be a finite number >= 0 (0 = greedy)"));
  }
  if (p.top_k() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".top_k=", p.top_k(), " must be >= 0 (0 = off)"));
  }
  if (!std::isfinite(p.top_p()) || p.top_p() < 0.0f || p.top_p() > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, ".top_p=", p.top_p(), " must be in [0, 1] (0 and 1 = off)"));
  }
  SamplingOptions o;
  o.temperature = p.temperature();
  o.top_k = p.top_k();
  // proto3's default 0 means "off", which the sampler spells 1.
  o.top_p = p.top_p() == 0.0f ? 1.0f : p.top_p();
  o.seed = p.has_seed() ? p.seed() : DefaultSeed(sequence_id);
  // The sampler's own rules; the checks above are stricter, so this only
  // fires if the two ever drift apart.
  if (absl::Status s = ValidateSamplingOptions(o); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", s.message()));
  }
  return o;
}

}  // namespace

uint64_t DefaultSeed(absl::string_view sequence_id) {
  return Fnv1a64(sequence_id);
}

absl::StatusOr<ForwardCallSpec> ValidateForwardRequest(
    const v1::ForwardRequest& request, const RequestLimits& limits) {
  const int n = request.sequences_size();
  if (n == 0) {
    return absl::InvalidArgumentError(
        "sequences is empty: a Forward call needs at least one sequence");
  }
  if (n > limits.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequences has ", n, " entries; max_num_seqs=", limits.max_num_seqs,
        " per call"));
  }
  ForwardCallSpec spec;
  spec.sequences.reserve(n);
  spec.after_step.reserve(n);
  absl::flat_hash_map<absl::string_view, int> first_index;
  first_index.reserve(n);
  for (int i = 0; i < n; ++i) {
    const v1::SequenceInput& in = request.sequences(i);
    const std::string field = absl::StrCat("sequences[", i, "]");
    if (absl::Status s =
            CheckSequenceId(field + ".sequence_id", in.sequence_id());
        !s.ok()) {
      return s;
    }
    if (auto [it, inserted] = first_index.emplace(in.sequence_id(), i);
        !inserted) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".sequence_id '", in.sequence_id(), "' repeats sequences[",
          it->second, "]: a sequence appears at most once per call"));
    }
    if (in.hold_for_handoff() && in.release_after_step()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field,
          ": hold_for_handoff and release_after_step exclude each other (a "
          "held sequence is freed by the decode worker's pull or its lease)"));
    }
    if (in.token_ids_size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".token_ids is empty"));
    }
    if (in.token_ids_size() > limits.max_model_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".token_ids has ", in.token_ids_size(),
                       " tokens; a sequence holds at most max_model_len=",
                       limits.max_model_len));
    }
    if (absl::Status s = CheckTokenIds(field + ".token_ids", in.token_ids(),
                                       limits.vocab_size);
        !s.ok()) {
      return s;
    }
    if (in.num_samples() < 0 || in.num_samples() > in.token_ids_size() ||
        in.num_samples() > limits.max_num_samples) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".num_samples=", in.num_samples(), " outside [0, min(",
          in.token_ids_size(), " token_ids, ", limits.max_num_samples,
          ")]; the worker samples at most 1 + num_speculative_tokens "
          "(--speculative_config) rows per sequence"));
    }
    absl::StatusOr<SamplingOptions> sampling =
        ToSamplingOptions(field + ".sampling", in.sampling(), in.sequence_id());
    if (!sampling.ok()) return sampling.status();

    SequenceStep step;
    step.sequence_id = in.sequence_id();
    step.token_ids.assign(in.token_ids().begin(), in.token_ids().end());
    step.sampling = *sampling;
    step.creation = in.start() ? SequenceCreation::kMustBeNew
                               : SequenceCreation::kMustExist;
    step.num_samples = std::max(1, in.num_samples());
    spec.total_tokens += in.token_ids_size();
    spec.sequences.push_back(std::move(step));
    spec.after_step.push_back(in.release_after_step() ? AfterStep::kRelease
                              : in.hold_for_handoff()
                                  ? AfterStep::kHoldForHandoff
                                  : AfterStep::kKeep);
  }
  return spec;
}

absl::StatusOr<std::vector<std::string>> ValidateReleaseRequest(
    const v1::ReleaseRequest& request) {
  if (request.sequence_ids_size() == 0) {
    return absl::InvalidArgumentError("sequence_ids is empty");
  }
  std::vector<std::string> ids;
  ids.reserve(request.sequence_ids_size());
  absl::flat_hash_map<absl::string_view, int> first_index;
  for (int i = 0; i < request.sequence_ids_size(); ++i) {
    const std::string& id = request.sequence_ids(i);
    const std::string field = absl::StrCat("sequence_ids[", i, "]");
    if (absl::Status s = CheckSequenceId(field, id); !s.ok()) return s;
    if (auto [it, inserted] = first_index.emplace(id, i); !inserted) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", id, "' repeats sequence_ids[", it->second, "]"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace pdworker
