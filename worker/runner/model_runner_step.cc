// ModelRunner's step (DESIGN.md's diagram, steps 1-6): Validate, Launch
// (KV reservation, dispatch), Enqueue (inputs, token feed, forward,
// sampling, read-back copies), Retire and Execute. Create, capture and the
// KV-cache operations are in model_runner.cc.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/token_ids.h"
#include "worker/kernels/feed_tokens.h"
#include "worker/kernels/logprobs.h"
#include "worker/runner/model_runner.h"

namespace pdworker {

ModelRunner::HostLayout ModelRunner::host_layout() const {
  // Every logits row's id and logprob, then the raw logprobs, top ids and
  // top logprobs of the rows of the sequences that asked.
  const size_t rows = static_cast<size_t>(max_logits_rows_);
  const size_t top = rows * kernels::kMaxTopLogprobs;
  HostLayout l;
  l.logprobs = l.ids + rows * sizeof(int32_t);
  l.raw = l.logprobs + rows * sizeof(float);
  l.top_ids = l.raw + rows * sizeof(float);
  l.top_values = l.top_ids + top * sizeof(int32_t);
  l.bytes = l.top_values + top * sizeof(float);
  return l;
}

absl::Status ModelRunner::Validate(absl::Span<const SequenceStep> batch) const {
  if (batch.empty()) {
    return absl::InvalidArgumentError("a step needs at least one sequence");
  }
  if (static_cast<int>(batch.size()) > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        batch.size(),
        " sequences in one step; max_num_seqs=", options_.max_num_seqs));
  }
  int64_t tokens = 0;
  for (const SequenceStep& s : batch) {
    if (s.token_ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "' has no new tokens"));
    }
    PDW_RETURN_IF_ERROR(
        CheckTokenIds(absl::StrCat("sequence '", s.sequence_id, "': token_ids"),
                      s.token_ids, config_.vocab_size));
    absl::Status sampling = ValidateSamplingOptions(s.sampling);
    if (!sampling.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "': ", sampling.message()));
    }
    const int64_t max_top =
        std::min<int64_t>(kernels::kMaxTopLogprobs, config_.vocab_size);
    if (s.num_top_logprobs < -1 || s.num_top_logprobs > max_top) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", s.sequence_id, "': num_top_logprobs=",
                       s.num_top_logprobs, " outside [-1, ", max_top, "]"));
    }
    if (s.num_samples < 1 ||
        s.num_samples > static_cast<int64_t>(s.token_ids.size()) ||
        s.num_samples > options_.uniform_decode_query_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", s.sequence_id, "': num_samples=", s.num_samples,
          " outside [1, min(", s.token_ids.size(),
          " new tokens, uniform_decode_query_len=",
          options_.uniform_decode_query_len, ")]"));
    }
    if (s.num_samples > 1) {
      if (s.last_token_from.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "': num_samples=", s.num_samples,
            " cannot be combined with "
            "last_token_from"));
      }
      // The multi-row unpack and uniform verify steps have not run on a
      // GPU yet (issue 45's wave runs model_runner_gpu_test's
      // SampledRowsMatchOneTokenSteps).
      if (device_.kind() == DeviceKind::kCuda &&
          options_.kernel_options.unverified_cuda_kernels !=
              UnverifiedCudaKernels::kAllow) {
        return absl::UnimplementedError(
            absl::StrCat("sequence '", s.sequence_id,
                         "': num_samples > 1 on CUDA has not run on a GPU yet; "
                         "--unverified_cuda_kernels=allow runs it"));
      }
    }
    if (s.banned_token_ids.size() > kMaxBannedTokensPerSequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", s.sequence_id, "': ", s.banned_token_ids.size(),
          " banned token ids; at most ", kMaxBannedTokensPerSequence));
    }
    if (s.last_token_from.has_value()) {
      const SampleRef& ref = *s.last_token_from;
      const bool in_flight = std::find(in_flight_.begin(), in_flight_.end(),
                                       ref.slot) != in_flight_.end();
      if (!in_flight || ref.row < 0 ||
          ref.row >= static_cast<int>(slots_[ref.slot].num_tokens.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", s.sequence_id, "': its last token comes from row ",
            ref.row, " of slot ", ref.slot, ", which is no step in flight"));
      }
    }
    tokens += static_cast<int64_t>(s.token_ids.size());
  }
  if (tokens > options_.max_num_batched_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokens, " tokens in one step; max_num_batched_tokens=",
                     options_.max_num_batched_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ModelRunner::Launch(absl::Span<const SequenceStep> batch) {
  if (steps_in_flight() >= kMaxStepsInFlight) {
    return absl::FailedPreconditionError(
        absl::StrCat(kMaxStepsInFlight, " steps in flight; retire one first"));
  }
  PDW_RETURN_IF_ERROR(Validate(batch));

  // 0. Blocks that left the window of a sequence that may give them back:
  // dead for every query from its current length on (a failed step leaves
  // them freed, which changes no result).
  if (free_window_ > 0) {
    for (const SequenceStep& s : batch) {
      if (s.window_blocks == WindowBlocks::kFree &&
          kv_->Find(s.sequence_id) != nullptr) {
        PDW_RETURN_IF_ERROR(
            kv_->FreeOutsideWindow(s.sequence_id, free_window_).status());
      }
    }
  }

  // 1. KV cache: all-or-nothing (also rejects duplicates and length limits).
  // A placeholder's id is unknown to the cache until its step retires.
  appends_.clear();
  append_token_ids_.clear();
  size_t placeholder_tokens = 0;
  for (const SequenceStep& s : batch) {
    if (s.last_token_from.has_value()) placeholder_tokens += s.token_ids.size();
  }
  append_token_ids_.reserve(placeholder_tokens);  // spans below stay valid
  for (const SequenceStep& s : batch) {
    absl::Span<const int32_t> ids = s.token_ids;
    if (s.last_token_from.has_value()) {
      const size_t at = append_token_ids_.size();
      append_token_ids_.insert(append_token_ids_.end(), s.token_ids.begin(),
                               s.token_ids.end());
      append_token_ids_.back() = kUnknownTokenId;
      ids = absl::MakeConstSpan(append_token_ids_).subspan(at);
    }
    appends_.push_back({s.sequence_id, static_cast<int32_t>(ids.size()),
                        s.creation, ids, s.num_samples});
  }
  PDW_ASSIGN_OR_RETURN(StepReservation reservation, kv_->Append(appends_));
  // The step computes what the prefix cache did not hold.
  cached_tokens_.clear();
  int num_tokens = 0, max_query_len = 0;
  for (size_t r = 0; r < batch.size(); ++r) {
    const int cached = reservation.entries[r].cached_tokens;
    const int q = static_cast<int>(batch[r].token_ids.size()) - cached;
    cached_tokens_.push_back(cached);
    num_tokens += q;
    max_query_len = std::max(max_query_len, q);
  }

  // 2. Dispatch.
  const int num_reqs = static_cast<int>(batch.size());
  const BatchKind kind = ClassifyBatch(num_tokens, num_reqs, max_query_len,
                                       options_.uniform_decode_query_len);
  const DispatchResult d = dispatcher_.Dispatch(num_tokens, kind, num_reqs);

  const int slot = next_slot_;
  absl::Status status = Enqueue(batch, d, slot);
  if (!status.ok()) {
    kv_->Undo(reservation);
    return absl::Status(
        status.code(),
        absl::StrCat("step failed and was undone: ", status.message()));
  }

  // 6. Statistics.
  stats_.Record(num_tokens, d.descriptor.num_tokens, d.mode);

  StepSlot& s = slots_[slot];
  s.reservation = std::move(reservation);
  s.cached_tokens = cached_tokens_;
  s.token_fills.clear();
  for (const SequenceStep& seq : batch) {
    if (!seq.last_token_from.has_value()) continue;
    const SampleRef& from = *seq.last_token_from;
    StepSlot& source = slots_[from.slot];
    source.token_fills.push_back({seq.sequence_id,
                                  kv_->Find(seq.sequence_id)->num_tokens - 1,
                                  source.row_ends[from.row] - 1});
  }
  s.info = StepInfo{};
  s.info.mode = d.mode;
  s.info.fallback_reason = d.reason;
  s.info.descriptor = d.descriptor;
  s.info.unpadded_tokens = num_tokens;
  s.info.padded_tokens = d.descriptor.num_tokens;
  s.info.num_sequences = num_reqs;
  s.previous_slot = last_launched_slot_;
  last_launched_slot_ = slot;
  next_slot_ = (slot + 1) % static_cast<int>(slots_.size());
  in_flight_.push_back(slot);
  return slot;
}

absl::Status ModelRunner::Enqueue(absl::Span<const SequenceStep> batch,
                                  const DispatchResult& d, int slot) {
  StepSlot& out = slots_[slot];
  const int num_reqs = static_cast<int>(batch.size());
  PDW_RETURN_IF_ERROR(stream_->RecordEvent(*out.start));

  // 3. Inputs with padding rows up to the key's shape, then the tokens
  // that steps in flight are still sampling, copied on the device.
  PaddedShape shape{d.descriptor.num_tokens, num_reqs, 0};
  if (d.mode != RuntimeMode::kNone && d.descriptor.uniform) {
    shape = {d.descriptor.num_tokens, d.descriptor.num_reqs,
             UniformQueryLen(d.descriptor)};
  }
  step_seqs_.clear();
  for (int r = 0; r < num_reqs; ++r) {
    step_seqs_.push_back(
        {kv_->Find(batch[r].sequence_id),
         absl::MakeConstSpan(batch[r].token_ids).subspan(cached_tokens_[r]),
         batch[r].num_samples});
  }
  PDW_RETURN_IF_ERROR(inputs_->Build(step_seqs_, shape));
  PDW_RETURN_IF_ERROR(inputs_->Upload(*stream_));
  // One feed launch per source step (in practice one: the step before).
  for (const int source : in_flight_) {
    // feed_'s layout: the source logits rows (each fed sequence's last
    // row there), then their destination token indices (its last token).
    const absl::Span<const int32_t> query_start =
        inputs_->host_query_start_loc();
    const std::vector<int32_t>& source_rows = slots_[source].row_ends;
    auto fed = [&](int r) {
      const std::optional<SampleRef>& from = batch[r].last_token_from;
      return from.has_value() && from->slot == source;
    };
    feed_host_.clear();
    for (int r = 0; r < num_reqs; ++r) {
      if (fed(r)) {
        feed_host_.push_back(source_rows[batch[r].last_token_from->row] - 1);
      }
    }
    const int num_feeds = static_cast<int>(feed_host_.size());
    if (num_feeds == 0) continue;
    for (int r = 0; r < num_reqs; ++r) {
      if (fed(r)) feed_host_.push_back(query_start[r + 1] - 1);
    }
    const size_t bytes = num_feeds * sizeof(int32_t);
    PDW_RETURN_IF_ERROR(
        stream_->CopyToDevice(feed_, feed_host_.data(), 2 * bytes));
    kernels::FeedSampledTokensParams feed;
    feed.sampled_token_ids = slots_[source].token_ids;
    feed.src_rows = feed_.Slice(0, bytes);
    feed.token_ids = inputs_->buffers().token_ids;
    feed.dst_indices = feed_.Slice(bytes, bytes);
    feed.num_feeds = num_feeds;
    feed.num_sampled = source_rows.empty() ? 0 : source_rows.back();
    feed.num_tokens = shape.num_tokens;
    PDW_RETURN_IF_ERROR(kernels::LaunchFeedSampledTokens(*stream_, feed));
  }

  // 4. Forward.
  const ForwardContext context{d.mode, d.descriptor};
  PDW_RETURN_IF_ERROR(forward_->Run(context));

  // 5. Sample the real rows, then copy the samples to the host. Raw
  // logprobs come from the logits before any mask or temperature.
  out.row_ends.clear();
  for (int r = 0; r < num_reqs; ++r) {
    out.row_ends.push_back((r == 0 ? 0 : out.row_ends.back()) +
                           batch[r].num_samples);
  }
  const int num_rows = out.row_ends.back();
  out.logprob_seqs.clear();
  out.logprob_rows.clear();
  out.logprob_num_top.clear();
  out.logprob_k = 0;
  for (int r = 0; r < num_reqs; ++r) {
    if (batch[r].num_top_logprobs < 0) continue;
    // Every row of the sequence, in order (its last is its next token's).
    for (int row = out.row_ends[r] - batch[r].num_samples;
         row < out.row_ends[r]; ++row) {
      out.logprob_seqs.push_back(r);
      out.logprob_rows.push_back(row);
      out.logprob_num_top.push_back(batch[r].num_top_logprobs);
    }
    out.logprob_k = std::max(out.logprob_k, batch[r].num_top_logprobs);
  }
  const int num_logprob_rows = static_cast<int>(out.logprob_rows.size());
  if (num_logprob_rows > 0) {
    PDW_RETURN_IF_ERROR(
        stream_->CopyToDevice(logprob_rows_, out.logprob_rows.data(),
                              num_logprob_rows * sizeof(int32_t)));
    kernels::TopLogprobsParams top;
    top.logits = forward_->logits();
    top.rows = logprob_rows_;
    top.logsumexp = logsumexp_;
    top.top_token_ids = top_token_ids_;
    top.top_logprobs = top_logprobs_;
    top.num_rows = num_logprob_rows;
    top.num_logit_rows = num_rows;
    top.vocab_size = static_cast<int>(config_.vocab_size);
    top.k = out.logprob_k;
    PDW_RETURN_IF_ERROR(kernels::LaunchTopLogprobs(*stream_, top));
  }
  sampling_.clear();
  sample_positions_.clear();
  banned_rows_.clear();
  banned_token_ids_.clear();
  out.num_tokens.clear();
  for (int r = 0; r < num_reqs; ++r) {
    const int32_t length = step_seqs_[r].kv->num_tokens;
    out.num_tokens.push_back(length);
    const int n = batch[r].num_samples;
    for (int j = 0; j < n; ++j) {
      const int row = out.row_ends[r] - n + j;
      sampling_.push_back(batch[r].sampling);
      // The sampled token's absolute position (the RNG counter): the
      // length after the step for the last row, one less per row before.
      sample_positions_.push_back(length - (n - 1 - j));
      for (const int32_t id : batch[r].banned_token_ids) {
        banned_rows_.push_back(row);
        banned_token_ids_.push_back(id);
      }
    }
  }
  SamplingBatch sampling;
  sampling.options = sampling_;
  sampling.positions = sample_positions_;
  sampling.banned_rows = banned_rows_;
  sampling.banned_token_ids = banned_token_ids_;
  sampling.greedy_tiles = forward_->GreedyTiles(context);
  PDW_RETURN_IF_ERROR(sampler_->Launch(*stream_, forward_->logits(), sampling,
                                       out.token_ids, out.logprobs));
  char* host = static_cast<char*>(out.host.data());
  const HostLayout layout = host_layout();
  PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(host + layout.ids, out.token_ids,
                                               num_rows * sizeof(int32_t)));
  PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
      host + layout.logprobs, out.logprobs, num_rows * sizeof(float)));
  if (num_logprob_rows > 0) {
    kernels::GatherLogprobsParams gather;
    gather.logits = forward_->logits();
    gather.rows = logprob_rows_;
    gather.token_ids = out.token_ids;
    gather.logsumexp = logsumexp_;
    gather.logprobs = raw_logprobs_;
    gather.num_rows = num_logprob_rows;
    gather.num_logit_rows = num_rows;
    gather.vocab_size = static_cast<int>(config_.vocab_size);
    PDW_RETURN_IF_ERROR(kernels::LaunchGatherLogprobs(*stream_, gather));
    PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
        host + layout.raw, raw_logprobs_, num_logprob_rows * sizeof(float)));
    const size_t top_count =
        static_cast<size_t>(num_logprob_rows) * out.logprob_k;
    if (top_count > 0) {
      PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
          host + layout.top_ids, top_token_ids_, top_count * sizeof(int32_t)));
      PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(
          host + layout.top_values, top_logprobs_, top_count * sizeof(float)));
    }
  }
  return stream_->RecordEvent(*out.end);
}

absl::StatusOr<StepResult> ModelRunner::Retire(int slot) {
  if (in_flight_.empty() || in_flight_.front() != slot) {
    return absl::FailedPreconditionError(
        absl::StrCat("Retire(", slot, "): not the oldest step in flight"));
  }
  in_flight_.pop_front();
  StepSlot& s = slots_[slot];
  PDW_RETURN_IF_ERROR(s.end->Synchronize());
  StepResult result;
  result.info = s.info;
  PDW_ASSIGN_OR_RETURN(const double device_ms,
                       s.end->ElapsedMillisecondsSince(*s.start));
  result.info.device_seconds = device_ms * 1e-3;
  if (s.previous_slot >= 0) {
    PDW_ASSIGN_OR_RETURN(
        const double idle_ms,
        s.start->ElapsedMillisecondsSince(*slots_[s.previous_slot].end));
    result.info.idle_before_seconds = std::max(idle_ms, 0.0) * 1e-3;
  }
  const int num_reqs = static_cast<int>(s.num_tokens.size());
  const HostLayout layout = host_layout();
  const char* host = static_cast<const char*>(s.host.data());
  const auto* ids = reinterpret_cast<const int32_t*>(host + layout.ids);
  const auto* logprobs = reinterpret_cast<const float*>(host + layout.logprobs);
  result.sequences.resize(num_reqs);
  for (int r = 0; r < num_reqs; ++r) {
    SequenceResult& out = result.sequences[r];
    const int last = s.row_ends[r] - 1;
    const int first = r == 0 ? 0 : s.row_ends[r - 1];
    out.token_id = ids[last];
    out.logprob = logprobs[last];
    out.prior_token_ids.assign(ids + first, ids + last);
    out.prior_logprobs.assign(logprobs + first, logprobs + last);
    out.num_tokens = s.num_tokens[r];
    out.cached_tokens = s.cached_tokens[r];
  }
  // The ids this step sampled complete later steps' blocks in the cache.
  for (const StepSlot::TokenFill& fill : s.token_fills) {
    kv_->SetTokenId(fill.sequence_id, fill.position, ids[fill.row]);
  }
  s.token_fills.clear();
  // Raw logprobs of the sequences that asked: entry i of the step's list.
  const auto* raw = reinterpret_cast<const float*>(host + layout.raw);
  const auto* top_ids = reinterpret_cast<const int32_t*>(host + layout.top_ids);
  const auto* top_values =
      reinterpret_cast<const float*>(host + layout.top_values);
  // A sequence's entries are its rows in order; the last is its next
  // token's, the others its prior rows'.
  for (size_t i = 0; i < s.logprob_seqs.size(); ++i) {
    const int r = s.logprob_seqs[i];
    SequenceResult& out = result.sequences[r];
    std::vector<TopLogprob> top;
    for (int j = 0; j < s.logprob_num_top[i]; ++j) {
      const size_t at = i * s.logprob_k + j;
      top.push_back({top_ids[at], top_values[at]});
    }
    if (s.logprob_rows[i] == s.row_ends[r] - 1) {
      out.raw_logprob = raw[i];
      out.top_logprobs = std::move(top);
    } else {
      out.prior_raw_logprobs.push_back(raw[i]);
      out.prior_top_logprobs.push_back(std::move(top));
    }
  }
  return result;
}

absl::StatusOr<StepResult> ModelRunner::Execute(
    absl::Span<const SequenceStep> batch) {
  if (steps_in_flight() > 0) {
    return absl::FailedPreconditionError(
        "Execute: steps are in flight; use Launch/Retire");
  }
  PDW_ASSIGN_OR_RETURN(const int slot, Launch(batch));
  absl::StatusOr<StepResult> result = Retire(slot);
  if (!result.ok()) {
    // The reservation is the latest Append: undo it so the runner is as
    // it was (a device fault leaves nothing else to trust anyway).
    kv_->Undo(slots_[slot].reservation);
    return absl::Status(result.status().code(),
                        absl::StrCat("step failed and was undone: ",
                                     result.status().message()));
  }
  return result;
}

}  // namespace pdworker
