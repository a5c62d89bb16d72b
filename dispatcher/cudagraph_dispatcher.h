// CudagraphDispatcher: the single source of truth for which CUDA graphs
// exist, and the per-step decision of which one (if any) a batch replays.
//
// Faithful to vLLM v1's CudagraphDispatcher:
//  - Initialize() builds two key sets from the resolved CudaGraphMode and the
//    capture sizes: PIECEWISE keys and FULL keys. The mixed routine gets one
//    *relaxed* key (num_tokens only) per capture size; a FULL decode routine
//    additionally gets one *uniform* key per capture size that a uniform
//    decode batch can reach (<= query_len * max_num_seqs), and, when
//    query_len > 1, one *one-token* uniform key {n, n} per capture size
//    n <= max_num_seqs (speculation configured, a step without drafts).
//  - Dispatch() pads the batch to the smallest capture size >= num_tokens and
//    looks keys up with priority exact FULL > relaxed FULL > relaxed
//    PIECEWISE > NONE. Above the largest capture size it returns NONE.
//
// Differences from vLLM, both deliberate:
//  - every NONE carries a FallbackReason (exported as a Prometheus label);
//  - uniform keys use sizes rounded down to multiples of the query length
//    (UniformDecodeSizes) with their own padding table, instead of rewriting
//    the global capture list, so speculative decoding never produces a
//    uniform key whose num_tokens is not num_reqs * query_len;
//  - with speculation, decode steps whose requests verify no drafts (one
//    token each) keep FULL graphs of their own instead of falling back to
//    PIECEWISE or eager (BatchKind::kOneTokenDecode).
//
// Hot path: Dispatch() is a bounds check plus two array loads; the decision
// for every (num_tokens, batch kind) is precomputed by Initialize() from the
// key sets, so it allocates nothing and is O(1) regardless of how many sizes
// were captured.
#ifndef PDWORKER_DISPATCHER_CUDAGRAPH_DISPATCHER_H_
#define PDWORKER_DISPATCHER_CUDAGRAPH_DISPATCHER_H_

#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "dispatcher/batch_descriptor.h"
#include "dispatcher/capture_lifecycle.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

// Why a batch runs eagerly. kNone means "not a fallback" (a graph was
// chosen). The snake_case names are stable: they are Prometheus label values.
enum class FallbackReason : uint8_t {
  kNone,                 // "none": a graph was dispatched
  kModeNone,             // "mode_none": cudagraph_mode is NONE
  kAboveMaxCaptureSize,  // "above_max_capture_size"
  kNoKeyForBatchShape,   // "no_key_for_batch_shape": e.g. a mixed batch
                         // under FULL_DECODE_ONLY
  kCaptureDisabled,      // "capture_disabled": graphs turned off at runtime
  kStillCapturing,       // "still_capturing": graphs not ready yet
};
inline constexpr int kNumFallbackReasons = 6;

// Stable snake_case name, e.g. "above_max_capture_size".
absl::string_view FallbackReasonName(FallbackReason reason);
std::ostream& operator<<(std::ostream& os, FallbackReason reason);

struct DispatchResult {
  RuntimeMode mode = RuntimeMode::kNone;
  // The padded key to replay for FULL/PIECEWISE; for NONE the unpadded,
  // relaxed shape {num_tokens, 0, false}.
  BatchDescriptor descriptor;
  FallbackReason reason = FallbackReason::kNone;

  friend bool operator==(const DispatchResult& a, const DispatchResult& b) {
    return a.mode == b.mode && a.descriptor == b.descriptor &&
           a.reason == b.reason;
  }
};
std::ostream& operator<<(std::ostream& os, const DispatchResult& r);

class CudagraphDispatcher {
 public:
  // Without a capture lifecycle every key counts as captured (kReady): tools
  // and tests see the key decisions directly.
  CudagraphDispatcher() = default;
  // Dispatch() answers NONE with kStillCapturing (stages kNotCaptured and
  // kCapturing) or kCaptureDisabled (kDisabled) unless `lifecycle` is
  // kReady. The model runner owns `lifecycle`, which must outlive the
  // dispatcher.
  explicit CudagraphDispatcher(const CaptureLifecycle& lifecycle)
      : lifecycle_(&lifecycle) {}
  CudagraphDispatcher(const CudagraphDispatcher&) = delete;
  CudagraphDispatcher& operator=(const CudagraphDispatcher&) = delete;

  // Builds the key sets and padding tables. `mode` must already be resolved
  // against the attention backends (see ResolveMode). `capture_sizes` must be
  // positive and strictly increasing, and non-empty unless mode is NONE.
  // May be called again to re-initialize; the capture lifecycle is not the
  // dispatcher's to change.
  absl::Status Initialize(CudaGraphMode mode,
                          const std::vector<int>& capture_sizes,
                          int max_num_seqs, int uniform_decode_query_len);

  // Picks the runtime mode and padded key for a batch of `num_tokens` query
  // tokens. `kind` says whether the batch is a uniform decode batch;
  // `num_reqs` is informational for uniform batches (the key's num_reqs is
  // derived from the padded token count) and ignored for mixed ones.
  // Safe to call while another thread moves the capture lifecycle along.
  DispatchResult Dispatch(int num_tokens, BatchKind kind,
                          int num_reqs = 0) const;

  // Graphs to capture, PIECEWISE first then FULL, each largest first (large
  // graphs first so smaller ones reuse the memory pool). Modes without keys
  // are omitted.
  std::vector<std::pair<RuntimeMode, std::vector<BatchDescriptor>>>
  GetCaptureDescs() const;

  // The key set for FULL or PIECEWISE (NONE has none: returns empty).
  const absl::flat_hash_set<BatchDescriptor>& keys(RuntimeMode mode) const;

  CudaGraphMode mode() const { return mode_; }
  const std::vector<int>& capture_sizes() const { return capture_sizes_; }
  // Sizes that got uniform-decode FULL keys (empty unless decode is FULL).
  const std::vector<int>& uniform_sizes() const { return uniform_sizes_; }
  // Sizes that got one-token decode FULL keys (empty unless decode is FULL
  // and the query length is above 1).
  const std::vector<int>& one_token_sizes() const { return one_token_sizes_; }
  int max_capture_size() const { return max_capture_size_; }
  int uniform_decode_query_len() const { return query_len_; }
  bool initialized() const { return initialized_; }

 private:
  // The un-precomputed decision, straight from the key sets; Initialize()
  // tabulates it for every num_tokens <= max_capture_size_.
  DispatchResult Decide(int num_tokens, BatchKind kind) const;

  CudaGraphMode mode_;
  std::vector<int> capture_sizes_;
  std::vector<int> uniform_sizes_;
  std::vector<int> one_token_sizes_;
  int max_capture_size_ = 0;
  int query_len_ = 1;
  bool initialized_ = false;

  absl::flat_hash_set<BatchDescriptor> full_keys_;
  absl::flat_hash_set<BatchDescriptor> piecewise_keys_;
  const absl::flat_hash_set<BatchDescriptor> no_keys_;  // keys(kNone)

  // padded_[n]: smallest capture size >= n (0 for n == 0), n in
  // [0, max_capture_size_]. uniform_padded_[n]: smallest uniform size >= n,
  // or 0 if none.
  std::vector<int> padded_;
  std::vector<int> uniform_padded_;
  std::vector<int> one_token_padded_;  // the same over one_token_sizes_

  // decisions_[kind][n]: precomputed Decide(n, kind) for the kReady stage.
  std::vector<DispatchResult> decisions_[3];

  // Not owned; nullptr: always ready.
  const CaptureLifecycle* lifecycle_ = nullptr;
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CUDAGRAPH_DISPATCHER_H_
