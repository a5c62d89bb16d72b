// The dispatch key of a captured CUDA graph.
#ifndef PDWORKER_DISPATCHER_BATCH_DESCRIPTOR_H_
#define PDWORKER_DISPATCHER_BATCH_DESCRIPTOR_H_

#include <ostream>
#include <string>
#include <utility>

namespace pdworker {

// Shape of one (possibly padded) batch, as seen by the graph dispatcher.
//
// `num_tokens` is the total number of query tokens in the step. For uniform
// decode batches (every sequence has exactly `uniform_decode_query_len` query
// tokens, so num_tokens == num_reqs * query_len) `uniform` is true and
// `num_reqs` is num_tokens / query_len. Mixed-batch keys are *relaxed*: only
// num_tokens matters, num_reqs is 0 and uniform is false.
struct BatchDescriptor {
  int num_tokens = 0;
  int num_reqs = 0;
  bool uniform = false;

  // The mixed-batch key for the same token count: drops num_reqs and
  // uniform. Idempotent.
  constexpr BatchDescriptor relaxed() const {
    return BatchDescriptor{num_tokens, 0, false};
  }

  // e.g. "BatchDescriptor(num_tokens=8, num_reqs=8, uniform=true)".
  std::string ToString() const;

  friend constexpr bool operator==(const BatchDescriptor& a,
                                   const BatchDescriptor& b) {
    return a.num_tokens == b.num_tokens && a.num_reqs == b.num_reqs &&
           a.uniform == b.uniform;
  }
  friend constexpr bool operator!=(const BatchDescriptor& a,
                                   const BatchDescriptor& b) {
    return !(a == b);
  }
  // Orders by num_tokens, then num_reqs, then uniform; used for sorted
  // listings (e.g. capture order), not for lookup.
  friend constexpr bool operator<(const BatchDescriptor& a,
                                  const BatchDescriptor& b) {
    if (a.num_tokens != b.num_tokens) return a.num_tokens < b.num_tokens;
    if (a.num_reqs != b.num_reqs) return a.num_reqs < b.num_reqs;
    return a.uniform < b.uniform;
  }

  template <typename H>
  friend H AbslHashValue(H h, const BatchDescriptor& d) {
    return H::combine(std::move(h), d.num_tokens, d.num_reqs, d.uniform);
  }
};

std::ostream& operator<<(std::ostream& os, const BatchDescriptor& d);

// Which dispatch routine a batch belongs to. A *uniform decode* batch has
// every sequence at exactly `uniform_decode_query_len` query tokens (1, or
// 1 + speculative tokens). A *one-token decode* batch has every sequence at
// one query token while uniform_decode_query_len is above 1 (speculation is
// configured, and no request verifies drafts this step): it gets FULL keys
// of its own, so a step without drafts does not lose its graph. Everything
// else (prefill, mixed prefill/decode, ragged speculative) is *mixed*.
enum class BatchKind { kMixed, kUniformDecode, kOneTokenDecode };

// Classifies a batch from its totals: uniform iff it has requests, its
// longest query is exactly `uniform_decode_query_len` and
// num_tokens == num_reqs * uniform_decode_query_len (so no query is
// shorter); one-token iff uniform_decode_query_len > 1 and every query is
// one token.
constexpr BatchKind ClassifyBatch(int num_tokens, int num_reqs,
                                  int max_query_len,
                                  int uniform_decode_query_len) {
  return (num_reqs > 0 && max_query_len == uniform_decode_query_len &&
          num_tokens == num_reqs * uniform_decode_query_len)
             ? BatchKind::kUniformDecode
         : (uniform_decode_query_len > 1 && num_reqs > 0 &&
            max_query_len == 1 && num_tokens == num_reqs)
             ? BatchKind::kOneTokenDecode
             : BatchKind::kMixed;
}

// The query length of every request of a uniform key (num_tokens /
// num_reqs: uniform_decode_query_len, or 1 for a one-token decode key); 0
// for a relaxed (mixed) key.
constexpr int UniformQueryLen(const BatchDescriptor& d) {
  return d.uniform && d.num_reqs > 0 ? d.num_tokens / d.num_reqs : 0;
}

std::ostream& operator<<(std::ostream& os, BatchKind kind);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_BATCH_DESCRIPTOR_H_
