#include "dispatcher/cudagraph_dispatcher.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "dispatcher/capture_sizes.h"
#include "glog/logging.h"

namespace pdworker {

absl::string_view FallbackReasonName(FallbackReason reason) {
  switch (reason) {
    case FallbackReason::kNone:
      return "none";
    case FallbackReason::kModeNone:
      return "mode_none";
    case FallbackReason::kAboveMaxCaptureSize:
      return "above_max_capture_size";
    case FallbackReason::kNoKeyForBatchShape:
      return "no_key_for_batch_shape";
    case FallbackReason::kCaptureDisabled:
      return "capture_disabled";
    case FallbackReason::kStillCapturing:
      return "still_capturing";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, FallbackReason reason) {
  return os << FallbackReasonName(reason);
}

std::ostream& operator<<(std::ostream& os, const DispatchResult& r) {
  return os << "{" << r.mode << ", " << r.descriptor << ", " << r.reason << "}";
}

namespace {

DispatchResult Eager(int num_tokens, FallbackReason reason) {
  return DispatchResult{RuntimeMode::kNone,
                        BatchDescriptor{num_tokens, 0, false}, reason};
}

// table[n] = smallest size >= n for n in [1, max]; table[0] = 0 (an empty
// batch pads to nothing). Sizes above `max` are ignored; n above the largest
// size gets 0 ("no size").
std::vector<int> BuildPaddingTable(const std::vector<int>& sizes, int max) {
  std::vector<int> table(static_cast<size_t>(max) + 1, 0);
  int n = 1;
  for (int size : sizes) {
    if (size > max) break;
    for (; n <= size; ++n) table[n] = size;
  }
  return table;
}

int KindIndex(BatchKind kind) {
  switch (kind) {
    case BatchKind::kUniformDecode:
      return 1;
    case BatchKind::kOneTokenDecode:
      return 2;
    case BatchKind::kMixed:
      break;
  }
  return 0;
}

}  // namespace

absl::Status CudagraphDispatcher::Initialize(
    CudaGraphMode mode, const std::vector<int>& capture_sizes, int max_num_seqs,
    int uniform_decode_query_len) {
  if (max_num_seqs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_seqs must be >= 1, got ", max_num_seqs));
  }
  if (uniform_decode_query_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform_decode_query_len must be >= 1, got ",
                     uniform_decode_query_len));
  }
  if (mode != CudaGraphMode::None()) {
    // The dispatcher does not know the step budget; ResolveCaptureSizes has
    // already checked sizes against it.
    absl::Status status = ValidateCaptureSizes(
        capture_sizes, std::numeric_limits<int>::max(), "capture_sizes");
    if (!status.ok()) return status;
  }

  mode_ = mode;
  query_len_ = uniform_decode_query_len;
  capture_sizes_ = capture_sizes;
  uniform_sizes_.clear();
  one_token_sizes_.clear();
  full_keys_.clear();
  piecewise_keys_.clear();
  padded_.clear();
  uniform_padded_.clear();
  one_token_padded_.clear();
  for (auto& d : decisions_) d.clear();
  max_capture_size_ = 0;
  initialized_ = true;
  if (mode == CudaGraphMode::None()) return absl::OkStatus();

  max_capture_size_ = capture_sizes.back();

  // Mixed routine: one relaxed key per capture size. The relaxed key ignores
  // num_reqs, so one graph serves every mixed batch padded to that size.
  if (mode.mixed_mode() != RuntimeMode::kNone) {
    auto& keys =
        mode.mixed_mode() == RuntimeMode::kFull ? full_keys_ : piecewise_keys_;
    for (int size : capture_sizes) {
      keys.insert(BatchDescriptor{size, 0, false});
    }
  }
  // Decode routine with FULL graphs: uniform keys, only for sizes a uniform
  // batch can reach (at most max_num_seqs requests of query_len tokens).
  // PIECEWISE decode needs no keys of its own: uniform batches fall back to
  // the relaxed mixed keys.
  if (mode.decode_mode() == RuntimeMode::kFull) {
    const int64_t max_uniform_tokens =
        static_cast<int64_t>(query_len_) * max_num_seqs;
    uniform_sizes_ = UniformDecodeSizes(
        capture_sizes, query_len_,
        static_cast<int>(std::min<int64_t>(max_uniform_tokens,
                                           std::numeric_limits<int>::max())));
    for (int size : uniform_sizes_) {
      full_keys_.insert(BatchDescriptor{size, size / query_len_, true});
    }
    // Speculation: steps where no request verifies drafts have one token
    // per request; {n, n} never equals a key {m, m / query_len} above.
    if (query_len_ > 1) {
      one_token_sizes_ = UniformDecodeSizes(capture_sizes, 1, max_num_seqs);
      for (int size : one_token_sizes_) {
        full_keys_.insert(BatchDescriptor{size, size, true});
      }
    }
  }

  padded_ = BuildPaddingTable(capture_sizes_, max_capture_size_);
  uniform_padded_ = BuildPaddingTable(uniform_sizes_, max_capture_size_);
  one_token_padded_ = BuildPaddingTable(one_token_sizes_, max_capture_size_);
  for (BatchKind kind : {BatchKind::kMixed, BatchKind::kUniformDecode,
                         BatchKind::kOneTokenDecode}) {
    auto& table = decisions_[KindIndex(kind)];
    table.reserve(static_cast<size_t>(max_capture_size_) + 1);
    for (int n = 0; n <= max_capture_size_; ++n) {
      table.push_back(Decide(n, kind));
    }
  }
  return absl::OkStatus();
}

DispatchResult CudagraphDispatcher::Decide(int num_tokens,
                                           BatchKind kind) const {
  // 1. Exact FULL key: only uniform decode batches have non-relaxed keys.
  if (kind != BatchKind::kMixed) {
    const bool one_token = kind == BatchKind::kOneTokenDecode;
    const int padded =
        (one_token ? one_token_padded_ : uniform_padded_)[num_tokens];
    if (padded > 0) {
      const BatchDescriptor exact{
          padded, one_token ? padded : padded / query_len_, true};
      if (full_keys_.contains(exact)) {
        return DispatchResult{RuntimeMode::kFull, exact, FallbackReason::kNone};
      }
    }
  }
  const int padded = padded_[num_tokens];
  if (padded > 0) {
    const BatchDescriptor relaxed{padded, 0, false};
    // 2. Relaxed FULL key (cudagraph_mode FULL: one graph for any batch).
    if (full_keys_.contains(relaxed)) {
      return DispatchResult{RuntimeMode::kFull, relaxed, FallbackReason::kNone};
    }
    // 3. Relaxed PIECEWISE key.
    if (piecewise_keys_.contains(relaxed)) {
      return DispatchResult{RuntimeMode::kPiecewise, relaxed,
                            FallbackReason::kNone};
    }
  }
  // 4. Eager, e.g. a mixed batch under FULL_DECODE_ONLY.
  return Eager(num_tokens, FallbackReason::kNoKeyForBatchShape);
}

DispatchResult CudagraphDispatcher::Dispatch(int num_tokens, BatchKind kind,
                                             int num_reqs) const {
  DCHECK(kind == BatchKind::kMixed || num_reqs == 0 ||
         num_tokens ==
             num_reqs * (kind == BatchKind::kOneTokenDecode ? 1 : query_len_))
      << kind << " batch with " << num_tokens << " tokens and " << num_reqs
      << " requests at query_len " << query_len_;
  if (!initialized_ || mode_ == CudaGraphMode::None()) {
    return Eager(num_tokens, FallbackReason::kModeNone);
  }
  if (lifecycle_ != nullptr) {
    switch (lifecycle_->stage()) {
      case CaptureStage::kReady:
        break;
      case CaptureStage::kNotCaptured:
      case CaptureStage::kCapturing:
        // The capture session runs its own forwards; real steps wait for
        // every key to have a graph.
        return Eager(num_tokens, FallbackReason::kStillCapturing);
      case CaptureStage::kDisabled:
        return Eager(num_tokens, FallbackReason::kCaptureDisabled);
    }
  }
  if (num_tokens > max_capture_size_) {
    return Eager(num_tokens, FallbackReason::kAboveMaxCaptureSize);
  }
  if (num_tokens < 0) {
    return Eager(num_tokens, FallbackReason::kNoKeyForBatchShape);
  }
  return decisions_[KindIndex(kind)][num_tokens];
}

std::vector<std::pair<RuntimeMode, std::vector<BatchDescriptor>>>
CudagraphDispatcher::GetCaptureDescs() const {
  std::vector<std::pair<RuntimeMode, std::vector<BatchDescriptor>>> out;
  for (RuntimeMode mode : {RuntimeMode::kPiecewise, RuntimeMode::kFull}) {
    const auto& set = keys(mode);
    if (set.empty()) continue;
    std::vector<BatchDescriptor> descs(set.begin(), set.end());
    // Largest first: later, smaller captures reuse the big one's memory.
    std::sort(descs.begin(), descs.end(),
              [](const BatchDescriptor& a, const BatchDescriptor& b) {
                return b < a;
              });
    out.emplace_back(mode, std::move(descs));
  }
  return out;
}

const absl::flat_hash_set<BatchDescriptor>& CudagraphDispatcher::keys(
    RuntimeMode mode) const {
  switch (mode) {
    case RuntimeMode::kFull:
      return full_keys_;
    case RuntimeMode::kPiecewise:
      return piecewise_keys_;
    case RuntimeMode::kNone:
      break;
  }
  return no_keys_;
}

}  // namespace pdworker
