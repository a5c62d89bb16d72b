// What the two skinny GEMMs (skinny_gemm.cu on CUDA cores, skinny_gemm_mma.cu
// on tensor cores) do with an output once its split-K slices are summed, and
// which kernel variant a launch instantiates: one definition, so both
// kernels' epilogues are the same operations (and the same bits as the
// separate kernels they replace). (nvcc only; a textual header.)
#ifndef PDWORKER_WORKER_KERNELS_SKINNY_EPILOGUE_CUH_
#define PDWORKER_WORKER_KERNELS_SKINNY_EPILOGUE_CUH_

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/rope_kv_row.cuh"

namespace pdworker {
namespace kernels {
namespace cuda {

// Output (t, o) of an unpaired epilogue (kNone, kAddResidual) from its
// slice sum: + bias, then one rounding; kAddResidual adds the bf16-rounded
// product to the residual stream in place (the fused add's arithmetic).
template <typename OutT, LinearCudaEpilogue kEpi>
__device__ __forceinline__ void StoreSkinnyRow(const LinearCudaParams& p, int t,
                                               int o, float sum) {
  if (p.bias != nullptr) sum += ToFloat(p.bias[o]);
  OutT* out = static_cast<OutT*>(p.output) +
              static_cast<int64_t>(t) * p.out_features + o;
  if constexpr (kEpi == LinearCudaEpilogue::kAddResidual) {
    sum = ToFloat(*out) + ToFloat(FromFloat<__nv_bfloat16>(sum));
  }
  *out = FromFloat<OutT>(sum);
}

// Pair j of a paired epilogue (kSiluAndMul: gate j and up j; kRopeKvCache:
// elements i and i + head_dim / 2 of one head, rows row0 and row0 +
// pair_offset) from the two slice sums: each + bias and rounded to bf16, as
// the unfused GEMM writes them; then silu(gate) · up into column j, or RoPE
// and the KV-cache write (rope_kv_row.cuh).
template <LinearCudaEpilogue kEpi>
__device__ __forceinline__ void StoreSkinnyPair(const LinearCudaParams& p,
                                                int t, int j, int row0,
                                                int pair_offset, float sum0,
                                                float sum1) {
  if (p.bias != nullptr) {
    sum0 += ToFloat(p.bias[row0]);
    sum1 += ToFloat(p.bias[row0 + pair_offset]);
  }
  const float x0 = ToFloat(FromFloat<__nv_bfloat16>(sum0));
  const float x1 = ToFloat(FromFloat<__nv_bfloat16>(sum1));
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.output);
  if constexpr (kEpi == LinearCudaEpilogue::kRopeKvCache) {
    StoreQkvPair(p.rope, y + static_cast<int64_t>(t) * p.out_features, t, row0,
                 x0, x1);
  } else {
    y[static_cast<int64_t>(t) * (p.out_features / 2) + j] =
        FromFloat<__nv_bfloat16>(SiluMul(x0, x1));
  }
}

// Calls launcher.template Run<OutT, kEpi, kNorm>() for p's output type,
// epilogue and prologue: the variants SkinnyFusionSupports admits (checked
// by the caller), and nothing else is instantiated.
template <typename Launcher>
cudaError_t DispatchSkinnyVariant(const LinearCudaParams& p,
                                  const Launcher& launcher) {
  using E = LinearCudaEpilogue;
  using bf16 = __nv_bfloat16;
  const bool norm = p.prologue == LinearCudaPrologue::kRmsNorm;
  switch (p.epilogue) {
    case E::kSiluAndMul:
      return norm ? launcher.template Run<bf16, E::kSiluAndMul, true>()
                  : launcher.template Run<bf16, E::kSiluAndMul, false>();
    case E::kAddResidual:
      return launcher.template Run<bf16, E::kAddResidual, false>();
    case E::kRopeKvCache:
      return norm ? launcher.template Run<bf16, E::kRopeKvCache, true>()
                  : launcher.template Run<bf16, E::kRopeKvCache, false>();
    case E::kNone:
      break;
  }
  if (norm) return launcher.template Run<bf16, E::kNone, true>();
  if (p.output_type == LinearCudaOutput::kFloat32) {
    return launcher.template Run<float, E::kNone, false>();
  }
  return launcher.template Run<bf16, E::kNone, false>();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_SKINNY_EPILOGUE_CUH_
