#include "worker/kernels/linear.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/linear_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "linear";

// Why not OpenBLAS sgemm: its result for one row depends on how many rows
// are computed with it and where the row sits in its register tile (measured
// on OpenBLAS 0.3.21: row 0 of an M=16 product differs in the last bits from
// the same row computed with M=1). A captured graph runs at the padded token
// count and eager runs at the real one, so sgemm would make graph and eager
// results differ, breaking DESIGN.md's "eager and replay are bit-identical".
// Here every output element is the same fixed sequence of fp32 operations
// (DotRow; the file is compiled with -ffp-contract=off), whatever the row
// count.

// One code path per output element: a 4-row blocked variant measured ~2x
// slower here (4-6 vs 8-11 GFLOP/s, accumulators spill), so rows are done one
// at a time while a 64-row tile of inputs stays hot in L2.
constexpr int kLanes = 8;       // partial sums per dot product
constexpr int kTokenTile = 64;  // token rows kept hot while weights stream

// The one definition of an output element: 8 interleaved partial sums over
// k (lane k % 8, in increasing k), a fixed pairwise reduction, then + bias.
inline float Reduce(const float (&acc)[kLanes]) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline float DotRow(const float* x, const float* w, int k) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * w[i + l];
  }
  for (int l = 0; i < k; ++i, ++l) acc[l] += x[i] * w[i];
  return Reduce(acc);
}

void LinearCpu(const LinearParams& p) {
  const float* x = p.input.as<const float>();
  const float* w = p.weight.as<const float>();
  const float* b = p.bias.empty() ? nullptr : p.bias.as<const float>();
  float* y = p.output.as<float>();
  const int k = p.in_features;
  // y[T, out] = x[T, in] · w[out, in]ᵀ (+ b).
  for (int t0 = 0; t0 < p.num_tokens; t0 += kTokenTile) {
    const int t1 = std::min(p.num_tokens, t0 + kTokenTile);
    for (int o = 0; o < p.out_features; ++o) {
      const float* wo = w + static_cast<int64_t>(o) * k;
      const float bias = b ? b[o] : 0.0f;
      for (int t = t0; t < t1; ++t) {
        y[static_cast<int64_t>(t) * p.out_features + o] =
            DotRow(x + static_cast<int64_t>(t) * k, wo, k) + bias;
      }
    }
  }
}

#if PDW_HAVE_CUDA
static_assert(kLinearSkinnyMaxTokens == kSkinnyGemmMaxTokens,
              "linear.h and linear_cuda.h agree on the skinny GEMMs' range");

LinearCudaParams ToLinearCudaParams(const LinearParams& p) {
  LinearCudaParams c;
  c.input = p.input.as<const __nv_bfloat16>();
  c.weight = p.weight.as<const __nv_bfloat16>();
  c.bias = p.bias.empty() ? nullptr : p.bias.as<const __nv_bfloat16>();
  c.output = p.output.data();
  c.output_type = p.output_dtype == DType::kFloat32
                      ? LinearCudaOutput::kFloat32
                      : LinearCudaOutput::kBFloat16;
  c.num_tokens = p.num_tokens;
  c.in_features = p.in_features;
  c.out_features = p.out_features;
  switch (p.kernel) {
    case LinearKernel::kAuto:
      c.kernel = LinearCudaKernel::kAuto;
      break;
    case LinearKernel::kCublas:
      c.kernel = LinearCudaKernel::kCublas;
      break;
    case LinearKernel::kSkinnyGemm:
      c.kernel = LinearCudaKernel::kSkinnyGemm;
      break;
    case LinearKernel::kSkinnyMma:
      c.kernel = LinearCudaKernel::kSkinnyMma;
      break;
  }
  switch (p.epilogue) {
    case LinearEpilogue::kNone:
      c.epilogue = LinearCudaEpilogue::kNone;
      break;
    case LinearEpilogue::kSiluAndMul:
      c.epilogue = LinearCudaEpilogue::kSiluAndMul;
      break;
    case LinearEpilogue::kAddResidual:
      c.epilogue = LinearCudaEpilogue::kAddResidual;
      break;
    case LinearEpilogue::kRopeKvCache:
      c.epilogue = LinearCudaEpilogue::kRopeKvCache;
      c.rope = ToRopeKvCacheCudaParams(p.rope);
      break;
  }
  if (p.prologue == LinearPrologue::kRmsNorm) {
    c.prologue = LinearCudaPrologue::kRmsNorm;
    c.norm_weight = p.norm_weight.as<const __nv_bfloat16>();
    c.norm_epsilon = p.norm_epsilon;
  }
  return c;
}

// LinearOnCuda's checks of the fusions and the forced kernel, and its
// launch params.
absl::StatusOr<LinearCudaParams> CheckedCudaParams(const Stream& stream,
                                                   const LinearParams& p) {
  const LinearCudaParams c = ToLinearCudaParams(p);
  if (p.epilogue == LinearEpilogue::kSiluAndMul && !LinearCanFuse(stream, p)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue silu_and_mul needs a skinny GEMM (num_tokens=%d; "
        "in_features a multiple of 8, aligned input and weight), an even "
        "out_features (got %d) and bf16 output",
        kOp, p.num_tokens, p.out_features));
  }
  if (p.epilogue == LinearEpilogue::kAddResidual && !LinearCanFuse(stream, p)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue add_residual needs a skinny GEMM (num_tokens=%d; one "
        "token on skinny_gemm), bf16 output and no prologue",
        kOp, p.num_tokens));
  }
  if (p.epilogue == LinearEpilogue::kRopeKvCache && !LinearCanFuse(stream, p)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue rope_kv_cache needs a skinny GEMM (num_tokens=%d; one "
        "token on skinny_gemm), bf16 output and out_features = (num_heads + "
        "2 * num_kv_heads) * head_dim (got %d)",
        kOp, p.num_tokens, p.out_features));
  }
  if (p.prologue == LinearPrologue::kRmsNorm && !LinearCanFuse(stream, p)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: prologue rms_norm needs a skinny GEMM (num_tokens=%d; one token "
        "on skinny_gemm), bf16 output, a 16-byte aligned norm_weight, "
        "num_tokens * (in_features + 8) * 2 <= %d bytes (in_features=%d) and "
        "epilogue none or silu_and_mul",
        kOp, p.num_tokens, kSkinnyNormMaxBytes, p.in_features));
  }
  if ((c.kernel == LinearCudaKernel::kSkinnyGemm && !SkinnyGemmSupports(c)) ||
      (c.kernel == LinearCudaKernel::kSkinnyMma && !SkinnyMmaSupports(c))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: kernel %s needs 1..%d tokens, in_features a multiple of 8 and "
        "16-byte aligned input and weight (num_tokens=%d, in_features=%d)",
        kOp,
        c.kernel == LinearCudaKernel::kSkinnyMma ? "skinny_mma" : "skinny_gemm",
        kSkinnyGemmMaxTokens, p.num_tokens, p.in_features));
  }
  return c;
}

absl::Status LinearOnCuda(Stream& stream, const LinearParams& p) {
  PDW_ASSIGN_OR_RETURN(const LinearCudaParams c, CheckedCudaParams(stream, p));
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    const LinearCudaResult result =
        LaunchLinearCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream),
                         static_cast<cublasHandle_t>(ctx.cublas_handle));
    absl::Status status = CudaStatus(result.launch, "linear kernel launch");
    if (!status.ok()) return status;
    return CublasStatus(result.cublas, "linear cublasGemmEx");
  });
}
#endif

// kRopeKvCache: `rope` passes LaunchRopeKvCache's checks and describes
// exactly the output's rows, so the fused epilogue writes what the RoPE
// kernel would.
absl::Status CheckRopeEpilogue(const Stream& stream, const LinearParams& p) {
  PDW_ASSIGN_OR_RETURN(const RopeKvCacheParams r,
                       ResolveRopeKvCache(stream, p.rope));
  // rope_kv_row.cuh rotates whole heads, unnormalized, unscaled.
  if (!r.q_norm_weight.empty() ||
      (r.rotary_dim != 0 && r.rotary_dim != r.head_dim) ||
      r.rotary_scale != 1.0f) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue rope_kv_cache does not implement q/k norm, partial "
        "rotary or rotary_scale (use the RoPE kernel after the projection)",
        kOp));
  }
  const size_t element = DTypeSize(p.dtype);
  const int q_width = r.num_heads * r.head_dim;
  const int kv_width = r.num_kv_heads * r.head_dim;
  const char* base = static_cast<const char*>(p.output.data());
  if (r.dtype != p.dtype || r.num_tokens != p.num_tokens ||
      p.out_features != q_width + 2 * kv_width || r.query.data() != base ||
      r.key.data() != base + element * q_width ||
      r.value.data() != base + element * (q_width + kv_width) ||
      r.query_row_stride != p.out_features ||
      r.key_row_stride != p.out_features ||
      r.value_row_stride != p.out_features) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue rope_kv_cache needs rope.query / key / value to be the "
        "output's column slices at 0, %d and %d with row stride "
        "out_features=%d, and rope's num_tokens and dtype to be the layer's "
        "(num_tokens=%d)",
        kOp, q_width, q_width + kv_width, p.out_features, p.num_tokens));
  }
  return absl::OkStatus();
}

// CPU: fp32 only. CUDA: bf16 operands, bf16 or fp32 output.
absl::Status CheckLinearDTypes(const Stream& stream, const LinearParams& p) {
  absl::Status status = CheckModelDType(stream, kOp, "dtype", p.dtype);
  if (!status.ok()) return status;
  if (p.output_dtype == p.dtype || (stream.kind() == DeviceKind::kCuda &&
                                    p.output_dtype == DType::kFloat32)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: output_dtype %s is not supported with %s operands on this backend",
      kOp, ShortDTypeName(p.output_dtype), ShortDTypeName(p.dtype)));
}

}  // namespace

bool LinearCanFuse(const Stream& stream, const LinearParams& p) {
  if (p.epilogue == LinearEpilogue::kNone &&
      p.prologue == LinearPrologue::kNone) {
    return true;
  }
#if PDW_HAVE_CUDA
  if (stream.kind() != DeviceKind::kCuda || p.dtype != DType::kBFloat16 ||
      p.output_dtype != DType::kBFloat16) {
    return false;
  }
  if (p.prologue == LinearPrologue::kRmsNorm &&
      p.norm_weight.size_bytes() <
          DTypeSize(p.dtype) * static_cast<size_t>(p.in_features)) {
    return false;
  }
  const LinearCudaParams c = ToLinearCudaParams(p);
  const LinearCudaKernel kernel = ChosenLinearCudaKernel(c);
  switch (kernel) {
    case LinearCudaKernel::kSkinnyGemm:
      return SkinnyGemmSupports(c) && SkinnyFusionSupports(c, kernel);
    case LinearCudaKernel::kSkinnyMma:
      return SkinnyMmaSupports(c) && SkinnyFusionSupports(c, kernel);
    case LinearCudaKernel::kAuto:
    case LinearCudaKernel::kCublas:
      return false;
  }
  return false;
#else
  (void)stream;
  return false;
#endif
}

namespace {

// Everything LaunchLinear checks before it picks the backend's kernel.
absl::Status CheckLinear(const Stream& stream, const LinearParams& p) {
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_tokens", p.num_tokens),
                  CheckPositive(kOp, "in_features", p.in_features),
                  CheckPositive(kOp, "out_features", p.out_features)});
  if (!status.ok()) return status;
  const int64_t in_elements =
      static_cast<int64_t>(p.num_tokens) * p.in_features;
  const int64_t weight_elements =
      static_cast<int64_t>(p.out_features) * p.in_features;
  // kSiluAndMul writes [num_tokens, out_features / 2].
  const int out_columns = p.epilogue == LinearEpilogue::kSiluAndMul
                              ? p.out_features / 2
                              : p.out_features;
  const int64_t out_elements = static_cast<int64_t>(p.num_tokens) * out_columns;
  status = CheckLinearDTypes(stream, p);
  if (!status.ok()) return status;
  const size_t element = DTypeSize(p.dtype);
  const size_t out_element = DTypeSize(p.output_dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  const size_t out_bytes = out_element * out_elements;
  status = FirstError(
      {CheckBuffer(kOp, "input", p.input, in_elements, element,
                   absl::StrFormat("[num_tokens=%d, in_features=%d] %s",
                                   p.num_tokens, p.in_features, type)),
       CheckBuffer(kOp, "weight", p.weight, weight_elements, element,
                   absl::StrFormat("[out_features=%d, in_features=%d] %s",
                                   p.out_features, p.in_features, type)),
       p.bias.empty()
           ? absl::OkStatus()
           : CheckBuffer(
                 kOp, "bias", p.bias, p.out_features, element,
                 absl::StrFormat("[out_features=%d] %s", p.out_features, type)),
       CheckBuffer(
           kOp, "output", p.output, out_elements, out_element,
           absl::StrFormat("[num_tokens=%d, %s=%d] %s", p.num_tokens,
                           p.epilogue == LinearEpilogue::kSiluAndMul
                               ? "out_features / 2"
                               : "out_features",
                           out_columns, ShortDTypeName(p.output_dtype))),
       CheckDisjoint(kOp, "output", p.output, out_bytes, "input", p.input,
                     element * in_elements),
       CheckDisjoint(kOp, "output", p.output, out_bytes, "weight", p.weight,
                     element * weight_elements),
       CheckDisjoint(kOp, "output", p.output, out_bytes, "bias", p.bias,
                     p.bias.empty() ? 0 : element * p.out_features),
       p.prologue == LinearPrologue::kRmsNorm
           ? CheckBuffer(
                 kOp, "norm_weight", p.norm_weight, p.in_features, element,
                 absl::StrFormat("[in_features=%d] %s", p.in_features, type))
           : absl::OkStatus(),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (p.epilogue == LinearEpilogue::kRopeKvCache) {
    PDW_RETURN_IF_ERROR(CheckRopeEpilogue(stream, p));
  }
  return absl::OkStatus();
}

}  // namespace

#if PDW_HAVE_CUDA
absl::StatusOr<LinearCudaParams> ResolveLinearCuda(const Stream& stream,
                                                   const LinearParams& p) {
  PDW_RETURN_IF_ERROR(CheckLinear(stream, p));
  if (stream.kind() != DeviceKind::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a CUDA stream", kOp));
  }
  return CheckedCudaParams(stream, p);
}
#endif

absl::Status LaunchLinear(Stream& stream, const LinearParams& p) {
  PDW_RETURN_IF_ERROR(CheckLinear(stream, p));
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return LinearOnCuda(stream, p);
#endif
  if (p.kernel != LinearKernel::kAuto) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: kernel must be auto on the %s backend (it has one GEMM)", kOp,
        DeviceKindName(stream.kind())));
  }
  if (p.epilogue != LinearEpilogue::kNone ||
      p.prologue != LinearPrologue::kNone) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: epilogue and prologue must be none on the %s backend "
        "(LinearCanFuse is false there)",
        kOp, DeviceKindName(stream.kind())));
  }
  return stream.Launch(kOp, [p](const OpContext&) { LinearCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
