#include "worker/runner/step_inputs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdworker {
namespace {

// The packed block at its largest: every array full and every request
// holding a full block-table row.
int64_t MaxPackedWords(const StepLimits& limits) {
  const kernels::PackedStepLayout l = kernels::PackedStepLayout::For(
      limits.max_num_batched_tokens, limits.max_num_seqs,
      limits.max_logits_rows);
  return l.block_ids +
         static_cast<int64_t>(limits.max_num_seqs) * limits.max_blocks_per_seq;
}

}  // namespace

int64_t StepInputs::DeviceWords(const StepLimits& limits) {
  const int64_t tokens = limits.max_num_batched_tokens;
  const int64_t seqs = limits.max_num_seqs;
  // token_ids, positions, slot_mapping; seq_lens, query_start_loc,
  // num_reqs; logits_indices; block_tables; then the packed block.
  return 3 * tokens + 2 * seqs + 2 + limits.max_logits_rows +
         seqs * limits.max_blocks_per_seq + MaxPackedWords(limits);
}

absl::StatusOr<std::unique_ptr<StepInputs>> StepInputs::Create(
    Device& device, Arena& arena, const StepLimits& limits,
    int32_t block_size) {
  if (limits.max_num_seqs <= 0 || limits.max_num_batched_tokens <= 0 ||
      limits.max_blocks_per_seq <= 0 || limits.max_uploads_in_flight <= 0 ||
      limits.max_logits_rows < limits.max_num_seqs || block_size <= 0) {
    return absl::InvalidArgumentError(
        "StepInputs: limits must be positive, max_logits_rows at least "
        "max_num_seqs");
  }
  const int64_t tokens = limits.max_num_batched_tokens;
  const int64_t seqs = limits.max_num_seqs;
  StepBuffers b;
  struct Slot {
    DeviceBuffer* buffer;
    int64_t elements;
    const char* label;
  };
  DeviceBuffer packed;
  const size_t packed_bytes =
      static_cast<size_t>(MaxPackedWords(limits)) * sizeof(int32_t);
  for (const Slot& s : {
           Slot{&b.token_ids, tokens, "token_ids"},
           Slot{&b.positions, tokens, "positions"},
           Slot{&b.slot_mapping, tokens, "slot_mapping"},
           Slot{&b.seq_lens, seqs, "seq_lens"},
           Slot{&b.query_start_loc, seqs + 1, "query_start_loc"},
           Slot{&b.num_reqs, 1, "num_reqs"},
           Slot{&b.block_tables, seqs * limits.max_blocks_per_seq,
                "block_tables"},
           Slot{&b.logits_indices, limits.max_logits_rows, "logits_indices"},
           Slot{&packed, MaxPackedWords(limits), "packed_step_inputs"},
       }) {
    PDW_ASSIGN_OR_RETURN(
        *s.buffer,
        arena.Allocate(static_cast<size_t>(s.elements) * sizeof(int32_t),
                       s.label));
  }
  PDW_ASSIGN_OR_RETURN(
      std::unique_ptr<UploadRing> ring,
      UploadRing::Create(device, packed_bytes, limits.max_uploads_in_flight));
  return std::unique_ptr<StepInputs>(new StepInputs(
      limits, block_size, std::move(b), packed, std::move(ring)));
}

StepInputs::StepInputs(const StepLimits& limits, int32_t block_size,
                       StepBuffers buffers, DeviceBuffer packed,
                       std::unique_ptr<UploadRing> ring)
    : limits_(limits),
      block_size_(block_size),
      buffers_(std::move(buffers)),
      packed_(packed),
      ring_(std::move(ring)) {}

absl::Status StepInputs::NextBlock(const PaddedShape& shape, int num_logits) {
  // Normally no wait: the copy out of this block was enqueued
  // max_uploads_in_flight uploads ago.
  PDW_RETURN_IF_ERROR(ring_->Next().status());
  shape_ = shape;
  layout_ = kernels::PackedStepLayout::For(shape.num_tokens, shape.num_reqs,
                                           num_logits);
  return absl::OkStatus();
}

absl::Status StepInputs::Build(absl::Span<const StepSequence> seqs,
                               const PaddedShape& shape) {
  int total = 0, num_logits = 0;
  for (const StepSequence& s : seqs) {
    if (s.kv == nullptr || s.new_tokens.empty() ||
        static_cast<int>(s.new_tokens.size()) > s.kv->num_tokens) {
      return absl::InvalidArgumentError(
          "StepInputs: each sequence needs KV state covering its new tokens");
    }
    if (s.num_logits < 1 ||
        s.num_logits > static_cast<int>(s.new_tokens.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("StepInputs: num_logits=", s.num_logits, " outside [1, ",
                       s.new_tokens.size(), " new tokens]"));
    }
    num_logits += s.num_logits;
    if (static_cast<int>(s.kv->blocks.size()) > limits_.max_blocks_per_seq) {
      return absl::InvalidArgumentError("StepInputs: block table too wide");
    }
    total += static_cast<int>(s.new_tokens.size());
  }
  const int num_reqs = static_cast<int>(seqs.size());
  if (num_reqs == 0 || shape.num_reqs < num_reqs ||
      shape.num_reqs > limits_.max_num_seqs || shape.num_tokens < total ||
      shape.num_tokens > limits_.max_num_batched_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("StepInputs: batch of ", num_reqs, " requests / ", total,
                     " tokens does not fit padded shape ", shape.num_reqs,
                     " / ", shape.num_tokens, " (limits ", limits_.max_num_seqs,
                     " / ", limits_.max_num_batched_tokens, ")"));
  }
  if (num_logits > limits_.max_logits_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StepInputs: ", num_logits,
        " logits rows; max_logits_rows=", limits_.max_logits_rows));
  }
  const int pad_reqs = shape.num_reqs - num_reqs;
  if (pad_reqs > 0 &&
      (shape.padding_query_len <= 0 ||
       total + pad_reqs * shape.padding_query_len != shape.num_tokens)) {
    return absl::InvalidArgumentError(
        "StepInputs: padding requests must exactly cover the padding tokens");
  }
  PDW_RETURN_IF_ERROR(NextBlock(shape, num_logits));

  int32_t* w = Staged();
  const kernels::PackedStepLayout& l = layout_;
  int32_t* token_ids = w + l.token_ids;
  int32_t* positions = w + l.positions;
  int32_t* slot_mapping = w + l.slot_mapping;
  int32_t* seq_lens = w + l.seq_lens;
  int32_t* query_start_loc = w + l.query_start_loc;
  int32_t* logits_indices = w + l.logits_indices;
  int32_t* block_starts = w + l.block_starts;
  int32_t* block_ids = w + l.block_ids;
  int t = 0, row = 0, num_block_ids = 0;
  query_start_loc[0] = 0;
  block_starts[0] = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const StepSequence& s = seqs[r];
    const int q_len = static_cast<int>(s.new_tokens.size());
    const int first_pos = s.kv->num_tokens - q_len;
    for (int j = 0; j < q_len; ++j, ++t) {
      const int pos = first_pos + j;
      token_ids[t] = s.new_tokens[j];
      positions[t] = pos;
      slot_mapping[t] =
          s.kv->blocks[pos / block_size_] * block_size_ + pos % block_size_;
    }
    seq_lens[r] = s.kv->num_tokens;
    query_start_loc[r + 1] = t;
    for (int j = s.num_logits; j > 0; --j) logits_indices[row++] = t - j;
    std::copy(s.kv->blocks.begin(), s.kv->blocks.end(),
              block_ids + num_block_ids);
    num_block_ids += static_cast<int>(s.kv->blocks.size());
    block_starts[r + 1] = num_block_ids;
  }
  // Padding tokens: read token 0 at position 0 and write no KV (slot -1).
  for (int p = t; p < shape.num_tokens; ++p) {
    token_ids[p] = 0;
    positions[p] = 0;
    slot_mapping[p] = -1;
  }
  // Padding requests (uniform keys only): empty context and no blocks, so
  // attention gives zeros and never touches a real sequence's blocks. They
  // have no logits rows: the unpack writes -1 (a zero row, so zero logits)
  // past the real rows, since a padding token's hidden state is not zero
  // (embedding of token 0 plus the MLP) and rows nobody reads should not
  // look like real logits, nor read a stale index from an earlier step.
  for (int r = num_reqs; r < shape.num_reqs; ++r) {
    seq_lens[r] = 0;
    query_start_loc[r + 1] = query_start_loc[r] + shape.padding_query_len;
    block_starts[r + 1] = num_block_ids;
  }
  num_tokens_ = total;
  num_reqs_ = num_reqs;
  num_logits_ = num_logits;
  num_block_ids_ = num_block_ids;
  return absl::OkStatus();
}

absl::Status StepInputs::BuildDummy(const PaddedShape& shape) {
  if (shape.num_tokens <= 0 ||
      shape.num_tokens > limits_.max_num_batched_tokens || shape.num_reqs < 0 ||
      shape.num_reqs > limits_.max_num_seqs ||
      (shape.num_reqs > 0 &&
       shape.num_reqs * shape.padding_query_len != shape.num_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("StepInputs: bad dummy shape ", shape.num_tokens, " / ",
                     shape.num_reqs));
  }
  PDW_RETURN_IF_ERROR(NextBlock(shape, /*num_logits=*/0));
  int32_t* w = Staged();
  const kernels::PackedStepLayout& l = layout_;
  std::fill_n(w + l.token_ids, shape.num_tokens, 0);
  std::fill_n(w + l.positions, shape.num_tokens, 0);
  std::fill_n(w + l.slot_mapping, shape.num_tokens, -1);
  std::fill_n(w + l.seq_lens, shape.num_reqs, 0);
  std::fill_n(w + l.block_starts, shape.num_reqs + 1, 0);
  int32_t* query_start_loc = w + l.query_start_loc;
  query_start_loc[0] = 0;
  for (int r = 0; r < shape.num_reqs; ++r) {
    query_start_loc[r + 1] = query_start_loc[r] + shape.padding_query_len;
  }
  num_tokens_ = 0;
  num_reqs_ = 0;
  num_logits_ = 0;
  num_block_ids_ = 0;
  return absl::OkStatus();
}

absl::Status StepInputs::Upload(Stream& stream) {
  if (shape_.num_tokens == 0) {
    return absl::FailedPreconditionError(
        "StepInputs::Upload before Build: nothing to copy");
  }
  const int64_t words = layout_.block_ids + num_block_ids_;
  PDW_RETURN_IF_ERROR(ring_->Upload(
      stream, packed_, static_cast<size_t>(words) * sizeof(int32_t)));
  kernels::UnpackStepInputsParams p;
  p.packed = packed_;
  p.outputs = buffers_;
  p.num_tokens = shape_.num_tokens;
  p.num_reqs = shape_.num_reqs;
  p.num_real_reqs = num_reqs_;
  p.num_block_ids = num_block_ids_;
  p.max_blocks_per_seq = limits_.max_blocks_per_seq;
  p.num_logits = num_logits_;
  p.num_logits_rows = limits_.max_logits_rows;
  return kernels::LaunchUnpackStepInputs(stream, p);
}

}  // namespace pdworker
