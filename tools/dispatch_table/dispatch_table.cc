// dispatch_table: prints what the CUDA graph dispatcher would do for a worker
// configuration, without a model or a device.
//
//   bazel run //tools/dispatch_table -- --role=decode --max_num_seqs=64
//   bazel run //tools/dispatch_table -- --role=both
//       --attention_support=UNIFORM_BATCH --compilation_config=
//       '{"cudagraph_mode":"FULL","cudagraph_capture_sizes":[1,2,4,8]}'
//
// Output: the configured and resolved mode (with the downgrade reason), the
// capture sizes, the FULL and PIECEWISE key sets, and for every num_tokens in
// 1 .. largest capture size + 1 the runtime mode and padded size of a mixed
// batch and of a uniform decode batch.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dispatcher/attention_cg_support.h"
#include "dispatcher/compilation_config.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/role_defaults.h"
#include "glog/logging.h"

ABSL_FLAG(std::string, role, "both", "Worker role: prefill, decode or both.");
ABSL_FLAG(std::string, compilation_config, "",
          "vLLM-style JSON: cudagraph_mode, cudagraph_capture_sizes, "
          "max_cudagraph_capture_size.");
ABSL_FLAG(int, max_num_seqs, 256, "Most sequences in one step.");
ABSL_FLAG(int, max_num_batched_tokens, 8192, "Most tokens in one step.");
ABSL_FLAG(int, uniform_decode_query_len, 1,
          "Query length of a uniform decode batch (1 + speculative tokens).");
ABSL_FLAG(std::string, attention_support, "ALWAYS",
          "Minimum CUDA graph support of the attention backends: NEVER, "
          "UNIFORM_SINGLE_TOKEN_DECODE, UNIFORM_BATCH or ALWAYS.");
ABSL_FLAG(bool, piecewise_compilation, true,
          "Whether the forward is split at attention (needed for PIECEWISE).");

namespace pdworker {
namespace {

std::string KeyString(const BatchDescriptor& d) {
  return d.uniform ? absl::StrCat(d.num_tokens, "(reqs=", d.num_reqs, ")")
                   : absl::StrCat(d.num_tokens);
}

std::string ResultString(const DispatchResult& r) {
  std::string out =
      absl::StrCat(RuntimeModeName(r.mode), " ", r.descriptor.num_tokens);
  if (r.descriptor.uniform)
    absl::StrAppend(&out, " reqs=", r.descriptor.num_reqs);
  if (r.reason != FallbackReason::kNone) {
    absl::StrAppend(&out, " (", FallbackReasonName(r.reason), ")");
  }
  return out;
}

absl::Status Run() {
  absl::StatusOr<Role> role = ParseRole(absl::GetFlag(FLAGS_role));
  if (!role.ok()) return role.status();
  absl::StatusOr<CompilationConfig> config =
      ParseCompilationConfig(absl::GetFlag(FLAGS_compilation_config));
  if (!config.ok()) return config.status();
  absl::StatusOr<AttentionCGSupport> support =
      ParseAttentionCGSupport(absl::GetFlag(FLAGS_attention_support));
  if (!support.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--attention_support: ", support.status().message()));
  }
  SchedulerLimits limits;
  limits.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  limits.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  limits.uniform_decode_query_len =
      absl::GetFlag(FLAGS_uniform_decode_query_len);
  absl::StatusOr<GraphPlan> plan = PlanGraphs(*role, *config, limits);
  if (!plan.ok()) return plan.status();

  const PiecewiseCompilation piecewise =
      absl::GetFlag(FLAGS_piecewise_compilation)
          ? PiecewiseCompilation::kAvailable
          : PiecewiseCompilation::kUnavailable;
  const ResolvedMode resolved = ResolveMode(plan->mode, *support, piecewise,
                                            limits.uniform_decode_query_len);

  CudagraphDispatcher dispatcher;
  absl::Status status = dispatcher.Initialize(
      resolved.mode, plan->capture_sizes, limits.max_num_seqs,
      limits.uniform_decode_query_len);
  if (!status.ok()) return status;

  std::ostream& out = std::cout;
  out << "role: " << *role << "\n"
      << "limits: max_num_seqs=" << limits.max_num_seqs
      << " max_num_batched_tokens=" << limits.max_num_batched_tokens
      << " uniform_decode_query_len=" << limits.uniform_decode_query_len << "\n"
      << "configured mode: " << plan->mode
      << (plan->mode_from_config ? " (compilation_config)" : " (role default)")
      << "\n"
      << "attention support: " << *support << ", piecewise compilation: "
      << (piecewise == PiecewiseCompilation::kAvailable ? "available"
                                                        : "unavailable")
      << "\n"
      << "resolved mode: " << resolved.mode
      << (resolved.reason.empty()
              ? " (unchanged)"
              : absl::StrCat(" (downgraded: ", resolved.reason, ")"))
      << "\n"
      << "capture sizes (" << plan->capture_sizes.size() << ", "
      << plan->capture_sizes_source << "): ["
      << absl::StrJoin(plan->capture_sizes, ", ") << "]\n";

  for (const auto& [mode, descs] : dispatcher.GetCaptureDescs()) {
    std::vector<std::string> keys;
    keys.reserve(descs.size());
    for (const BatchDescriptor& d : descs) keys.push_back(KeyString(d));
    out << RuntimeModeName(mode) << " keys (" << descs.size()
        << ", capture order): " << absl::StrJoin(keys, " ") << "\n";
  }
  if (dispatcher.GetCaptureDescs().empty()) out << "no graph keys\n";

  const int q = limits.uniform_decode_query_len;
  const int last = dispatcher.max_capture_size() + 1;
  // With speculation (q > 1), decode steps where nobody drafts have one
  // token per request: their own column.
  out << "\n| num_tokens | mixed batch | uniform decode batch |"
      << (q > 1 ? " one-token decode batch |" : "") << "\n"
      << "|------------|-------------|----------------------|"
      << (q > 1 ? "------------------------|" : "") << "\n";
  for (int n = 1; n <= last; ++n) {
    const std::string uniform = n % q == 0
                                    ? ResultString(dispatcher.Dispatch(
                                          n, BatchKind::kUniformDecode, n / q))
                                    : "-";
    out << "| " << n << " | "
        << ResultString(dispatcher.Dispatch(n, BatchKind::kMixed)) << " | "
        << uniform << " |";
    if (q > 1) {
      out << " "
          << (n <= limits.max_num_seqs ? ResultString(dispatcher.Dispatch(
                                             n, BatchKind::kOneTokenDecode, n))
                                       : std::string("-"))
          << " |";
    }
    out << "\n";
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Prints the CUDA graph dispatch table for a pdworker configuration.");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  absl::Status status = pdworker::Run();
  if (!status.ok()) {
    std::cerr << "dispatch_table: " << status << "\n";
    return 1;
  }
  return 0;
}
