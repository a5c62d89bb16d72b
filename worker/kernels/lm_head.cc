#include "worker/kernels/lm_head.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/sampling.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/lm_head_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

void GatherRowsCpu(const GatherRowsParams& p) {
  const int32_t* indices = p.indices.as<const int32_t>();
  const float* in = p.input.as<const float>();
  float* out = p.output.as<float>();
  const size_t row_bytes = sizeof(float) * p.row_size;
  for (int i = 0; i < p.num_indices; ++i) {
    float* dst = out + static_cast<int64_t>(i) * p.row_size;
    const int32_t index = indices[i];
    if (index < 0 || index >= p.num_input_rows) {
      std::memset(dst, 0, row_bytes);
    } else {
      std::memcpy(dst, in + static_cast<int64_t>(index) * p.row_size,
                  row_bytes);
    }
  }
}

#if PDW_HAVE_CUDA
absl::Status GatherRowsOnCuda(Stream& stream, const GatherRowsParams& p) {
  GatherRowsCudaParams c;
  c.input = p.input.as<const __nv_bfloat16>();
  c.indices = p.indices.as<const int32_t>();
  c.output = p.output.as<__nv_bfloat16>();
  c.num_input_rows = p.num_input_rows;
  c.num_indices = p.num_indices;
  c.row_size = p.row_size;
  return LaunchCudaOp(stream, "gather_rows", [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchGatherRowsCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        "gather_rows");
  });
}

GreedyHeadCudaParams GreedyHeadFor(const LmHeadParams& p) {
  GreedyHeadCudaParams c;
  const DeviceBuffer rows = p.logits_indices.empty() ? p.hidden : p.gathered;
  c.hidden = rows.as<const __nv_bfloat16>();
  c.weight = p.weight.as<const __nv_bfloat16>();
  c.logits = p.logits.as<float>();
  c.tiles = p.greedy_tiles.data();
  c.in_features = p.hidden_size;
  c.vocab_size = p.vocab_size;
  if (!p.norm_weight.empty()) {
    c.norm_weight = p.norm_weight.as<const __nv_bfloat16>();
    c.norm_epsilon = p.norm_epsilon;
    c.row_index = p.norm_row_index.as<const int32_t>();
    c.num_input_rows = p.num_tokens;
  }
  return c;
}
#endif

}  // namespace

bool LmHeadWritesGreedyTiles(const Stream& stream, const LmHeadParams& p) {
#if PDW_HAVE_CUDA
  return !p.greedy_tiles.empty() && stream.kind() == DeviceKind::kCuda &&
         p.num_rows == 1 && p.dtype == DType::kBFloat16 &&
         (p.linear_kernel == LinearKernel::kAuto ||
          p.linear_kernel == LinearKernel::kSkinnyGemm) &&
         (p.norm_weight.empty() || p.logits_indices.empty()) &&
         p.softcap == 0.0f &&  // the tiles fold uncapped logits
         GreedyHeadCudaSupports(GreedyHeadFor(p));
#else
  (void)stream;
  (void)p;
  return false;
#endif
}

absl::Status LaunchGatherRows(Stream& stream, const GatherRowsParams& p) {
  constexpr char kOp[] = "gather_rows";
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_input_rows", p.num_input_rows),
                  CheckPositive(kOp, "num_indices", p.num_indices),
                  CheckPositive(kOp, "row_size", p.row_size),
                  CheckModelDType(stream, kOp, "dtype", p.dtype)});
  if (!status.ok()) return status;
  const int64_t in_elements =
      static_cast<int64_t>(p.num_input_rows) * p.row_size;
  const int64_t out_elements = static_cast<int64_t>(p.num_indices) * p.row_size;
  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, in_elements, element,
                   absl::StrFormat("[num_input_rows=%d, row_size=%d] %s",
                                   p.num_input_rows, p.row_size, type)),
       CheckBuffer(kOp, "indices", p.indices, p.num_indices, sizeof(int32_t),
                   absl::StrFormat("[num_indices=%d] int32", p.num_indices)),
       CheckBuffer(kOp, "output", p.output, out_elements, element,
                   absl::StrFormat("[num_indices=%d, row_size=%d] %s",
                                   p.num_indices, p.row_size, type)),
       CheckDisjoint(kOp, "output", p.output, element * out_elements, "input",
                     p.input, element * in_elements),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return GatherRowsOnCuda(stream, p);
#endif
  return stream.Launch(kOp, [p](const OpContext&) { GatherRowsCpu(p); });
}

absl::Status LaunchLmHead(Stream& stream, const LmHeadParams& p) {
  // Checked up front so that a bad logits buffer fails before the gather is
  // launched (a launcher either launches everything or nothing).
  constexpr char kOp[] = "lm_head";
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_tokens", p.num_tokens),
                  CheckPositive(kOp, "num_rows", p.num_rows),
                  CheckPositive(kOp, "hidden_size", p.hidden_size),
                  CheckPositive(kOp, "vocab_size", p.vocab_size),
                  CheckModelDType(stream, kOp, "dtype", p.dtype)});
  if (!status.ok()) return status;
  const bool gather = !p.logits_indices.empty();
  const int64_t gathered_elements =
      static_cast<int64_t>(p.num_rows) * p.hidden_size;
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_rows) * p.vocab_size;
  const int64_t weight_elements =
      static_cast<int64_t>(p.vocab_size) * p.hidden_size;
  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  // The GEMM's input: the gathered rows, or `hidden` itself.
  const DeviceBuffer rows = gather ? p.gathered : p.hidden;
  status = FirstError(
      {CheckBuffer(
           kOp, "hidden", p.hidden,
           static_cast<int64_t>(gather || !p.norm_weight.empty() ? p.num_tokens
                                                                 : p.num_rows) *
               p.hidden_size,
           element,
           gather || !p.norm_weight.empty()
               ? absl::StrFormat("[num_tokens=%d, hidden_size=%d] %s",
                                 p.num_tokens, p.hidden_size, type)
               : absl::StrFormat("[num_rows=%d, hidden_size=%d] %s (no "
                                 "logits_indices: the rows themselves)",
                                 p.num_rows, p.hidden_size, type)),
       gather ? CheckBuffer(kOp, "logits_indices", p.logits_indices, p.num_rows,
                            sizeof(int32_t),
                            absl::StrFormat("[num_rows=%d] int32", p.num_rows))
              : absl::OkStatus(),
       gather ? CheckBuffer(kOp, "gathered", p.gathered, gathered_elements,
                            element,
                            absl::StrFormat("[num_rows=%d, hidden_size=%d] %s",
                                            p.num_rows, p.hidden_size, type))
              : absl::OkStatus(),
       CheckBuffer(kOp, "weight", p.weight, weight_elements, element,
                   absl::StrFormat("[vocab_size=%d, hidden_size=%d] %s",
                                   p.vocab_size, p.hidden_size, type)),
       CheckBuffer(kOp, "logits", p.logits, logits_elements, sizeof(float),
                   absl::StrFormat("[num_rows=%d, vocab_size=%d] fp32",
                                   p.num_rows, p.vocab_size)),
       CheckDisjoint(kOp, "logits", p.logits, sizeof(float) * logits_elements,
                     gather ? "gathered" : "hidden", rows,
                     element * gathered_elements),
       CheckDisjoint(kOp, "logits", p.logits, sizeof(float) * logits_elements,
                     "weight", p.weight, element * weight_elements),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;

  if (!(p.softcap >= 0.0f) || std::isinf(p.softcap)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "lm_head: softcap must be finite and >= 0 (0: none), got %g",
        p.softcap));
  }
  // Checked before the gather, which launches first.
  if (!p.greedy_tiles.empty()) {
    PDW_RETURN_IF_ERROR(CheckBuffer(kOp, "greedy_tiles", p.greedy_tiles,
                                    static_cast<int64_t>(GreedyTilesBytes(1)),
                                    1, "one row's tile folds"));
  }
  if (!p.norm_weight.empty()) {
    if (p.greedy_tiles.empty() || gather) {
      return absl::InvalidArgumentError(
          "lm_head: 'norm_weight' (the head's own final norm) needs "
          "greedy_tiles and no logits_indices");
    }
    PDW_RETURN_IF_ERROR(FirstError(
        {CheckBuffer(
             kOp, "norm_weight", p.norm_weight, p.hidden_size, element,
             absl::StrFormat("[hidden_size=%d] %s", p.hidden_size, type)),
         CheckBuffer(kOp, "norm_row_index", p.norm_row_index, 1,
                     sizeof(int32_t), "[1] int32")}));
  }
  if (!p.greedy_tiles.empty() && !LmHeadWritesGreedyTiles(stream, p)) {
    return absl::InvalidArgumentError(
        "lm_head: 'greedy_tiles' is set where the head cannot write them "
        "(they need CUDA, one bf16 row, linear_kernel kAuto or kSkinnyGemm, "
        "hidden_size a multiple of 8 and 16-byte aligned rows and weight)");
  }

  if (gather) {
    GatherRowsParams g;
    g.input = p.hidden;
    g.indices = p.logits_indices;
    g.output = p.gathered;
    g.num_input_rows = p.num_tokens;
    g.num_indices = p.num_rows;
    g.row_size = p.hidden_size;
    g.dtype = p.dtype;
    status = LaunchGatherRows(stream, g);
    if (!status.ok()) return status;
  }

#if PDW_HAVE_CUDA
  if (!p.greedy_tiles.empty()) {
    const GreedyHeadCudaParams c = GreedyHeadFor(p);
    return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
      return CudaStatus(
          LaunchGreedyHeadCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
          "lm_head (greedy tiles)");
    });
  }
#endif
  LinearParams linear;
  linear.input = rows;
  linear.weight = p.weight;
  linear.output = p.logits;
  linear.num_tokens = p.num_rows;
  linear.in_features = p.hidden_size;
  linear.out_features = p.vocab_size;
  linear.dtype = p.dtype;
  linear.output_dtype = DType::kFloat32;
  linear.kernel = p.linear_kernel;
  PDW_RETURN_IF_ERROR(LaunchLinear(stream, linear));
  if (p.softcap == 0.0f) return absl::OkStatus();
  const int64_t count = static_cast<int64_t>(p.num_rows) * p.vocab_size;
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    float* logits = p.logits.as<float>();
    const float cap = p.softcap;
    return LaunchCudaOp(
        stream, "lm_head softcap", [logits, count, cap](const OpContext& ctx) {
          return CudaStatus(LaunchLogitSoftcapCuda(
                                logits, count, cap,
                                static_cast<cudaStream_t>(ctx.cuda_stream)),
                            "lm_head softcap");
        });
  }
#endif
  return stream.Launch("lm_head softcap", [p, count](const OpContext&) {
    float* logits = p.logits.as<float>();
    for (int64_t i = 0; i < count; ++i) {
      logits[i] = p.softcap * std::tanh(logits[i] / p.softcap);
    }
  });
}

}  // namespace kernels
}  // namespace pdworker
