// Per-role CUDA graph defaults and how the compilation config overrides them.
//
//   prefill -> PIECEWISE over SGLang's piecewise token schedule up to
//              max_num_batched_tokens. Prefill steps are shaped by token
//              count and a chunked prefill fills the whole step budget, so
//              the sizes must reach the budget; vLLM's rule stops at
//              min(2 * max_num_seqs * query_len, 512), which would send most
//              prefill steps to eager. SGLang's schedule reaches the budget
//              with coarser steps as sizes grow (4 .. 512 .. 4096 .. budget),
//              keeping both the padding waste per step and the number of
//              graphs bounded. Attention stays eager, so PIECEWISE is the
//              only mode that works for arbitrary prompt lengths.
//   decode  -> FULL_DECODE_ONLY over SGLang's decode batch-size schedule up
//              to max_num_seqs (the speculative variant when query_len > 1),
//              each batch size times query_len tokens. A decode worker only
//              sees uniform decode batches (plus rare ragged ones, which run
//              eagerly) and saves the memory of piecewise graphs.
//   both    -> FULL_AND_PIECEWISE over vLLM's default sizes (aggregated
//              serving is exactly vLLM's default setup).
#ifndef PDWORKER_DISPATCHER_ROLE_DEFAULTS_H_
#define PDWORKER_DISPATCHER_ROLE_DEFAULTS_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dispatcher/compilation_config.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

enum class Role { kPrefill, kDecode, kBoth };

// "prefill", "decode" or "both".
absl::string_view RoleName(Role role);
std::ostream& operator<<(std::ostream& os, Role role);
// Parses the names above (case-insensitive); InvalidArgument lists them.
absl::StatusOr<Role> ParseRole(absl::string_view name);

// Scheduler limits the capture sizes must respect (flag values).
struct SchedulerLimits {
  int max_num_seqs = 256;
  int max_num_batched_tokens = 8192;
  int uniform_decode_query_len = 1;  // 1 + speculative tokens
};

// The configured (not yet attention-resolved) graph plan for a worker.
struct GraphPlan {
  CudaGraphMode mode;  // role default or the config's cudagraph_mode
  bool mode_from_config = false;
  std::vector<int> capture_sizes;    // token counts, ascending; empty for NONE
  std::string capture_sizes_source;  // human-readable, for logs and tools
};

// The role's default mode (see the file comment).
CudaGraphMode DefaultModeForRole(Role role);

// Applies `config` on top of the role defaults:
//  - cudagraph_mode replaces the role's mode;
//  - cudagraph_capture_sizes / max_cudagraph_capture_size are reconciled by
//    ResolveCaptureSizes against the role's default schedule (a given max
//    regenerates that schedule up to it).
// With mode NONE and no explicit list, no sizes are produced. Errors name the
// flag or field (max_num_seqs, max_num_batched_tokens,
// uniform_decode_query_len, cudagraph_capture_sizes, ...).
absl::StatusOr<GraphPlan> PlanGraphs(Role role, const CompilationConfig& config,
                                     const SchedulerLimits& limits);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_ROLE_DEFAULTS_H_
