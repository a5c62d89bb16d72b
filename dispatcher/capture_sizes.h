// Capture-size schedules: which num_tokens values get a captured graph.
//
// All sizes are *token counts* (the dispatcher's BatchDescriptor::num_tokens).
// A valid list is non-empty, positive, strictly increasing (sorted, unique)
// and bounded by max_num_batched_tokens (no step can be larger than the step
// budget, so a bigger graph would never be replayed and only waste memory).
#ifndef PDWORKER_DISPATCHER_CAPTURE_SIZES_H_
#define PDWORKER_DISPATCHER_CAPTURE_SIZES_H_

#include <functional>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// vLLM's default capture sizes:
//   [1, 2, 4] + [8, 16, ..., 248] + [256, 272, ..., max]
// every entry <= max, where max = min(2 * max_num_seqs * query_len, 512)
// clamped to max_num_batched_tokens. The factor 2 leaves headroom for mixed
// batches whose token count exceeds the number of sequences.
// Requires all arguments >= 1.
std::vector<int> VllmDefaultCaptureSizes(int max_num_seqs,
                                         int uniform_decode_query_len,
                                         int max_num_batched_tokens);

// The largest size VllmDefaultCaptureSizes would use, i.e.
// min(2 * max_num_seqs * query_len, 512, max_num_batched_tokens).
int VllmDefaultMaxCaptureSize(int max_num_seqs, int uniform_decode_query_len,
                              int max_num_batched_tokens);

// The vLLM rule with an explicit upper bound instead of the derived one:
// [1, 2, 4] + 8..248 step 8 + 256..max_size step 16, entries <= max_size.
std::vector<int> VllmCaptureSizesUpTo(int max_size);

// Whether SGLang's decode schedule is the plain one or the speculative one
// (finer granularity at small batch sizes, because with draft tokens every
// padded request costs query_len tokens).
enum class SglangDecodeSchedule { kNormal, kSpeculative };

// SGLang's default decode CUDA-graph batch sizes (server_args.py,
// _generate_cuda_graph_batch_sizes), entries <= max_bs:
//   kNormal:      [1, 2, 4, 8, 12] + 16..256 step 8 + 272..496 step 16
//                 + 512..max_bs step 32
//   kSpeculative: 1..8 step 1 + 10..32 step 2 + 40..64 step 4
//                 + 72..256 step 8 + 272..max_bs step 16
// These are *batch sizes* (requests); multiply by the query length to get
// token counts.
std::vector<int> SglangDecodeBatchSizes(int max_bs,
                                        SglangDecodeSchedule schedule);

// SGLang's piecewise (prefill) token schedule
// (_generate_piecewise_cuda_graph_tokens), entries <= max_tokens:
//   4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64,
//   1280..4096 step 256, 4608..max_tokens step 512.
std::vector<int> SglangPiecewiseTokenSizes(int max_tokens);

// Checks that `sizes` is non-empty, positive, strictly increasing and every
// entry is <= max_num_batched_tokens. Errors are InvalidArgument and name
// `field_name` (e.g. "cudagraph_capture_sizes") and the offending entry.
absl::Status ValidateCaptureSizes(const std::vector<int>& sizes,
                                  int max_num_batched_tokens,
                                  absl::string_view field_name);

// What the user asked for in the compilation config; both optional.
struct CaptureSizeRequest {
  std::optional<std::vector<int>> explicit_sizes;  // cudagraph_capture_sizes
  std::optional<int> max_capture_size;             // max_cudagraph_capture_size
};

// Produces a role's default schedule whose largest entry is <= max_size
// (max_size >= 1), e.g. VllmCaptureSizesUpTo.
using ScheduleUpTo = std::function<std::vector<int>(int max_size)>;

// Resolves `request` against a role's default schedule, the way vLLM's
// compilation config reconciles its two fields:
//  - both given: max_cudagraph_capture_size must equal the largest listed
//    size, else InvalidArgument naming both fields;
//  - only the list: validated (ValidateCaptureSizes) and used as is;
//  - only the max: must be >= 1; if it exceeds max_num_batched_tokens it is
//    truncated to it with a glog WARNING (a graph larger than the step budget
//    can never be replayed); result is schedule(max);
//  - neither: schedule(min(default_max, max_num_batched_tokens)); that clamp
//    is part of the default rule, so it is silent.
// The result is validated before it is returned, so an empty schedule (e.g.
// SGLang's piecewise schedule with a budget below 4 tokens) is an error.
absl::StatusOr<std::vector<int>> ResolveCaptureSizes(
    const CaptureSizeRequest& request, const ScheduleUpTo& schedule,
    int default_max, int max_num_batched_tokens);

// The sizes usable for uniform-decode keys: every size rounded *down* to a
// multiple of `query_len` (so it never exceeds the original size), zeros
// dropped, deduplicated, and only sizes <= max_uniform_tokens
// (= query_len * max_num_seqs) kept. With query_len == 1 this is the input
// list filtered to <= max_uniform_tokens. Input must be sorted ascending.
std::vector<int> UniformDecodeSizes(const std::vector<int>& capture_sizes,
                                    int query_len, int max_uniform_tokens);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CAPTURE_SIZES_H_
