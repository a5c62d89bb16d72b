// How much CUDA-graph capture the attention backends support, and how the
// configured CudaGraphMode is downgraded to what they can do.
#ifndef PDWORKER_DISPATCHER_ATTENTION_CG_SUPPORT_H_
#define PDWORKER_DISPATCHER_ATTENTION_CG_SUPPORT_H_

#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

// Ordered by capability: kNever < kUniformSingleTokenDecode < kUniformBatch <
// kAlways. A model with several attention backends uses the minimum.
enum class AttentionCGSupport {
  kNever = 0,                     // attention can never be inside a graph
  kUniformSingleTokenDecode = 1,  // only batches of 1-token decodes
  kUniformBatch = 2,              // batches whose queries all have one length
                                  // (decode, or spec-decode verification)
  kAlways = 3,                    // any batch, mixed prefill/decode included
};

// "NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH" or "ALWAYS".
absl::string_view AttentionCGSupportName(AttentionCGSupport support);
std::ostream& operator<<(std::ostream& os, AttentionCGSupport support);
// Parses the names above (case-insensitive); InvalidArgument lists them.
absl::StatusOr<AttentionCGSupport> ParseAttentionCGSupport(
    absl::string_view name);

// Whether the forward is split at attention into pieces, which PIECEWISE
// graphs need (vLLM: attention in splitting_ops under VLLM_COMPILE).
enum class PiecewiseCompilation { kAvailable, kUnavailable };

struct ResolvedMode {
  CudaGraphMode mode;
  // Why `mode` differs from the configured one ("; "-joined when several
  // rules fired); empty when unchanged. The caller logs it once at startup.
  std::string reason;
};

// Downgrades `configured` to what `min_support` and the compilation allow,
// following vLLM v1 (VllmConfig.__post_init__ and
// GPUModelRunner._check_and_update_cudagraph_mode), applied in this order:
//  0. A mode that needs PIECEWISE graphs without piecewise compilation
//     becomes NONE (vLLM: "not compatible with compilation mode ...
//     Overriding to NONE").
//  1. FULL graphs for *mixed* batches need kAlways. Below that (but above
//     kNever) FULL becomes FULL_AND_PIECEWISE if piecewise compilation is
//     available, else FULL_DECODE_ONLY: decode batches keep full graphs.
//  2. FULL graphs for *decode* batches need more than kNever: a decode FULL
//     mode becomes PIECEWISE if piecewise compilation is available, else
//     NONE. (vLLM raises for FULL mixed + NEVER in step 1; we apply this
//     downgrade instead so every configuration resolves.)
//  3. With speculative decoding (query_len > 1) decode FULL graphs need
//     kUniformBatch: kUniformSingleTokenDecode is treated like kNever for
//     full graphs, i.e. PIECEWISE if available, else NONE.
// The result never has full graphs under kNever, never needs piecewise
// without it, and is unchanged when min_support is kAlways and piecewise
// compilation is available.
ResolvedMode ResolveMode(CudaGraphMode configured,
                         AttentionCGSupport min_support,
                         PiecewiseCompilation piecewise,
                         int uniform_decode_query_len);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_ATTENTION_CG_SUPPORT_H_
