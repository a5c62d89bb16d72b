#include "worker/runner/step_inputs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdworker {
namespace {

absl::StatusOr<DeviceBuffer> Int32Buffer(Arena& arena, int64_t elements,
                                         absl::string_view label) {
  return arena.Allocate(static_cast<size_t>(elements) * sizeof(int32_t), label);
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepInputs>> StepInputs::Create(
    Arena& arena, const StepLimits& limits, int32_t block_size) {
  if (limits.max_num_seqs <= 0 || limits.max_num_batched_tokens <= 0 ||
      limits.max_blocks_per_seq <= 0 || block_size <= 0) {
    return absl::InvalidArgumentError("StepInputs: limits must be positive");
  }
  const int64_t tokens = limits.max_num_batched_tokens;
  const int64_t seqs = limits.max_num_seqs;
  StepBuffers b;
  struct Slot {
    DeviceBuffer* buffer;
    int64_t elements;
    const char* label;
  };
  for (const Slot& s : {
           Slot{&b.token_ids, tokens, "token_ids"},
           Slot{&b.positions, tokens, "positions"},
           Slot{&b.slot_mapping, tokens, "slot_mapping"},
           Slot{&b.seq_lens, seqs, "seq_lens"},
           Slot{&b.query_start_loc, seqs + 1, "query_start_loc"},
           Slot{&b.num_reqs, 1, "num_reqs"},
           Slot{&b.block_tables, seqs * limits.max_blocks_per_seq,
                "block_tables"},
           Slot{&b.logits_indices, seqs, "logits_indices"},
       }) {
    absl::StatusOr<DeviceBuffer> buf = Int32Buffer(arena, s.elements, s.label);
    if (!buf.ok()) return buf.status();
    *s.buffer = *buf;
  }
  return std::unique_ptr<StepInputs>(
      new StepInputs(limits, block_size, std::move(b)));
}

StepInputs::StepInputs(const StepLimits& limits, int32_t block_size,
                       StepBuffers buffers)
    : limits_(limits),
      block_size_(block_size),
      buffers_(std::move(buffers)),
      token_ids_(limits.max_num_batched_tokens),
      positions_(limits.max_num_batched_tokens),
      slot_mapping_(limits.max_num_batched_tokens),
      seq_lens_(limits.max_num_seqs),
      query_start_loc_(limits.max_num_seqs + 1),
      block_tables_(static_cast<size_t>(limits.max_num_seqs) *
                    limits.max_blocks_per_seq),
      logits_indices_(limits.max_num_seqs) {}

absl::Status StepInputs::Build(absl::Span<const StepSequence> seqs,
                               const PaddedShape& shape) {
  int total = 0;
  for (const StepSequence& s : seqs) {
    if (s.kv == nullptr || s.new_tokens.empty() ||
        static_cast<int>(s.new_tokens.size()) > s.kv->num_tokens) {
      return absl::InvalidArgumentError(
          "StepInputs: each sequence needs KV state covering its new tokens");
    }
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
  const int pad_reqs = shape.num_reqs - num_reqs;
  if (pad_reqs > 0 &&
      (shape.padding_query_len <= 0 ||
       total + pad_reqs * shape.padding_query_len != shape.num_tokens)) {
    return absl::InvalidArgumentError(
        "StepInputs: padding requests must exactly cover the padding tokens");
  }

  int t = 0;
  query_start_loc_[0] = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const StepSequence& s = seqs[r];
    const int q_len = static_cast<int>(s.new_tokens.size());
    const int first_pos = s.kv->num_tokens - q_len;
    for (int j = 0; j < q_len; ++j, ++t) {
      const int pos = first_pos + j;
      token_ids_[t] = s.new_tokens[j];
      positions_[t] = pos;
      slot_mapping_[t] =
          s.kv->blocks[pos / block_size_] * block_size_ + pos % block_size_;
    }
    seq_lens_[r] = s.kv->num_tokens;
    query_start_loc_[r + 1] = t;
    logits_indices_[r] = t - 1;
    int32_t* row =
        &block_tables_[static_cast<size_t>(r) * limits_.max_blocks_per_seq];
    std::copy(s.kv->blocks.begin(), s.kv->blocks.end(), row);
    std::fill(row + s.kv->blocks.size(), row + limits_.max_blocks_per_seq, 0);
  }
  // Padding tokens: read token 0 at position 0 and write no KV (slot -1).
  for (int p = t; p < shape.num_tokens; ++p) {
    token_ids_[p] = 0;
    positions_[p] = 0;
    slot_mapping_[p] = -1;
  }
  // Padding requests (uniform keys only): empty context, so attention gives
  // zeros and never touches a real sequence's blocks. Their logits index is
  // -1 (a zero row, so zero logits): their padding token's hidden state is
  // not zero (embedding of token 0 plus the MLP), and rows nobody reads
  // should not look like real logits.
  for (int r = num_reqs; r < shape.num_reqs; ++r) {
    seq_lens_[r] = 0;
    query_start_loc_[r + 1] = query_start_loc_[r] + shape.padding_query_len;
    logits_indices_[r] = -1;
    int32_t* row =
        &block_tables_[static_cast<size_t>(r) * limits_.max_blocks_per_seq];
    std::fill(row, row + limits_.max_blocks_per_seq, 0);
  }
  // Rows the LM head may compute beyond the padded requests read -1 (zero
  // logits) instead of a stale index from an earlier step.
  std::fill(logits_indices_.begin() + shape.num_reqs, logits_indices_.end(),
            -1);
  num_tokens_ = total;
  num_reqs_ = num_reqs;
  shape_ = shape;
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
  std::fill_n(token_ids_.begin(), shape.num_tokens, 0);
  std::fill_n(positions_.begin(), shape.num_tokens, 0);
  std::fill_n(slot_mapping_.begin(), shape.num_tokens, -1);
  query_start_loc_[0] = 0;
  for (int r = 0; r < shape.num_reqs; ++r) {
    seq_lens_[r] = 0;
    query_start_loc_[r + 1] = query_start_loc_[r] + shape.padding_query_len;
    std::fill_n(block_tables_.begin() +
                    static_cast<size_t>(r) * limits_.max_blocks_per_seq,
                limits_.max_blocks_per_seq, 0);
  }
  std::fill(logits_indices_.begin(), logits_indices_.end(), -1);
  num_tokens_ = 0;
  num_reqs_ = 0;
  shape_ = shape;
  return absl::OkStatus();
}

absl::Status StepInputs::Upload(Stream& stream) const {
  const size_t tok = static_cast<size_t>(shape_.num_tokens) * sizeof(int32_t);
  const size_t req = static_cast<size_t>(shape_.num_reqs) * sizeof(int32_t);
  const int32_t num_reqs = num_reqs_;
  struct Copy {
    DeviceBuffer dst;
    const void* src;
    size_t bytes;
  };
  for (const Copy& c : {
           Copy{buffers_.token_ids, token_ids_.data(), tok},
           Copy{buffers_.positions, positions_.data(), tok},
           Copy{buffers_.slot_mapping, slot_mapping_.data(), tok},
           Copy{buffers_.seq_lens, seq_lens_.data(), req},
           Copy{buffers_.query_start_loc, query_start_loc_.data(),
                req + sizeof(int32_t)},
           Copy{buffers_.num_reqs, &num_reqs, sizeof(int32_t)},
           Copy{buffers_.block_tables, block_tables_.data(),
                req * limits_.max_blocks_per_seq},
           Copy{buffers_.logits_indices, logits_indices_.data(),
                logits_indices_.size() * sizeof(int32_t)},
       }) {
    if (c.bytes == 0) continue;
    absl::Status s = stream.CopyToDevice(c.dst, c.src, c.bytes);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace pdworker
