#include "worker/runner/context_length.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

absl::StatusOr<int> ResolveContextLength(const ContextLengthParams& params,
                                         ModelConfig* config) {
  const ModelConfig& c = *config;
  int max_model_len = params.requested > 0
                          ? params.requested
                          : static_cast<int>(c.max_position_embeddings);
  if (max_model_len > c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_model_len=", max_model_len,
                     " exceeds the model's max_position_embeddings=",
                     c.max_position_embeddings));
  }

  const bool windows_unsupported =
      c.sliding_window.has_value() && params.device != DeviceKind::kCpu &&
      params.unverified_cuda_kernels != UnverifiedCudaKernels::kAllow;
  if (windows_unsupported && params.requested <= 0 &&
      max_model_len > *c.sliding_window) {
    LOG(WARNING) << "the model uses sliding-window attention (window "
                 << *c.sliding_window << " tokens), which the "
                 << DeviceKindName(params.device)
                 << " kernels do not run yet (--unverified_cuda_kernels="
                    "allow runs them): max_model_len defaults to the window, "
                    "not "
                 << max_model_len;
    max_model_len = static_cast<int>(*c.sliding_window);
  }
  if (windows_unsupported && max_model_len > *c.sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model uses sliding-window attention (window ", *c.sliding_window,
        " tokens), which the ", DeviceKindName(params.device),
        " kernels do not run yet; set max_model_len <= ", *c.sliding_window,
        " (or serve it with --device=cpu, or try "
        "--unverified_cuda_kernels=allow)"));
  }

  if (c.rope_scaling.type == RopeScalingType::kLongrope) {
    config->rope_scaling.long_factor_active =
        max_model_len > c.rope_scaling.original_max_position_embeddings;
    LOG(INFO) << "longrope: max_model_len=" << max_model_len
              << (c.rope_scaling.long_factor_active ? " > " : " <= ")
              << "original_max_position_embeddings="
              << c.rope_scaling.original_max_position_embeddings << ": "
              << (c.rope_scaling.long_factor_active ? "long" : "short")
              << "_factor";
  }
  return max_model_len;
}

}  // namespace pdworker
