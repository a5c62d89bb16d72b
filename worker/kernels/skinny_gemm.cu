// Skinny GEMM for decode batches: Y[T, O] = X[T, I] · W[O, I]ᵀ (+ b) with
// T <= kSkinnyGemmMaxTokens, bf16 operands, fp32 accumulation, bf16 or fp32
// output. At T = 1..8 a decode step is a weight stream: cuBLAS reaches ~62%
// of HBM on the small projections (bench/RESULTS.md), this kernel reads each
// weight row once with 16-byte loads and keeps enough of them in flight.
//
// Work split (CTA = 8 warps):
//  - the k axis is cut into chunks of 256 elements (32 lanes × 8 bf16, one
//    16-byte load per lane);
//  - a warp owns `rows_per_warp` (R) output rows and one of `k_split` (S)
//    slices of the chunks (chunk c belongs to slice c % S), so narrow
//    matrices still give the GPU O·S warps of work (split-K);
//  - the S slices of a row sit in one CTA and are summed through shared
//    memory in slice order: no atomics, no second launch.
//
// Batch invariance: every output element is the same sequence of fp32
// operations whatever T and R are: lane l accumulates, with fmaf, its 8
// elements of each of its slice's chunks in increasing k; the warp sums its
// lanes with a fixed shuffle-down tree; the slices are added in order 0..S-1;
// the bias is added last, then one rounding. S depends on (O, I) alone
// (SkinnyGemmKSplit), so row t of a padded graph replay and of an eager run
// at the real token count carry the same bits.
//
// Programmatic dependent launch: the kernel issues its first weight loads
// (weights never change during a step) before griddepcontrol.wait, which
// returns once the previous kernel in the stream has finished and its writes
// are visible; X is read and Y written only after it. Launched without the
// attribute, the wait returns at once.
#include <algorithm>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"
#include "worker/kernels/skinny_gemm_cta.cuh"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kWarps = cuda::kSkinnyWarps;
constexpr int kThreads = cuda::kSkinnyThreads;

template <int NT, int R, int U, typename OutT, LinearCudaEpilogue kEpi,
          bool kNorm>
__global__ void __launch_bounds__(kThreads)
    SkinnyGemmKernel(const LinearCudaParams p, int k_split) {
  // A fused decode step chains skinny GEMMs back to back (o_proj -> gate_up
  // -> down -> next qkv): let the next one be scheduled as soon as every
  // CTA of this one has started, so its weight loads overlap this grid's
  // tail. It reads nothing this grid writes before griddepcontrol.wait.
  cuda::AllowDependentLaunch();
  cuda::SkinnyGemmCta<NT, R, U, OutT, kEpi, kNorm>(p, k_split, blockIdx.x);
}

template <int NT, typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
cudaError_t LaunchForTokens(const LinearCudaParams& p, int k_split,
                            cudaStream_t stream) {
  using Shape = cuda::SkinnyShape<NT, kEpi>;
  return cuda::LaunchKernel(
      SkinnyGemmKernel<NT, Shape::R, Shape::U, OutT, kEpi, kNorm>,
      dim3(cuda::SkinnyGemmCtas<NT, kEpi>(p.out_features, k_split)),
      dim3(kThreads),
      kNorm ? sizeof(__nv_bfloat16) * p.num_tokens * p.in_features : 0, stream,
      p.programmatic_launch ? cuda::DependentLaunch::kProgrammatic
                            : cuda::DependentLaunch::kSerialized,
      p, k_split);
}

template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
cudaError_t LaunchForOutput(const LinearCudaParams& p, int k_split,
                            cudaStream_t stream) {
  // The fusions of a decode step run at one token (SkinnyFusionSupports):
  // the CUDA-core kernel is kAuto's choice there only.
  if constexpr (kNorm || kEpi == LinearCudaEpilogue::kAddResidual ||
                kEpi == LinearCudaEpilogue::kRopeKvCache) {
    if (p.num_tokens != 1) return cudaErrorInvalidValue;
    return LaunchForTokens<1, OutT, kEpi, kNorm>(p, k_split, stream);
  } else {
    // Kernels for 1, 2, 4 and 8 tokens; 3, 5, 6 and 7 run the next one up
    // with its extra token rows skipped (the same operations per element:
    // rows stay bit-identical), which halves the instantiations nvcc builds.
    if (p.num_tokens == 1) {
      return LaunchForTokens<1, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    if (p.num_tokens == 2) {
      return LaunchForTokens<2, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    if (p.num_tokens <= 4) {
      return LaunchForTokens<4, OutT, kEpi, kNorm>(p, k_split, stream);
    }
    return LaunchForTokens<8, OutT, kEpi, kNorm>(p, k_split, stream);
  }
}

// The variant cuda::DispatchSkinnyVariant picks.
struct Launcher {
  const LinearCudaParams& p;
  int k_split;
  cudaStream_t stream;
  template <typename OutT, LinearCudaEpilogue kEpi, bool kNorm>
  cudaError_t Run() const {
    return LaunchForOutput<OutT, kEpi, kNorm>(p, k_split, stream);
  }
};

}  // namespace

int SkinnyGemmKSplit(int in_features, int out_features) {
  // About 4,096 warp-slices of work, no more (measured on an H200 at one
  // token, bench/RESULTS.md: the best factor of every 0.5B / 1B projection
  // within 0.8 µs), and >= 2 chunks per slice so a warp still has loads to
  // overlap.
  const int num_chunks =
      (in_features + cuda::kSkinnyChunk - 1) / cuda::kSkinnyChunk;
  int k_split = 1;
  while (k_split < kWarps &&
         static_cast<int64_t>(out_features) * k_split * 2 < 8192 &&
         num_chunks >= 4 * k_split) {
    k_split *= 2;
  }
  return k_split;
}

bool SkinnyGemmSupports(const LinearCudaParams& p) {
  return p.num_tokens >= 1 && p.num_tokens <= kSkinnyGemmMaxTokens &&
         p.in_features % 8 == 0 && cuda::Aligned16(p.input) &&
         cuda::Aligned16(p.weight);
}

cudaError_t LaunchSkinnyGemmCuda(const LinearCudaParams& p, int k_split,
                                 cudaStream_t stream) {
  if (!SkinnyGemmSupports(p) || k_split < 1 || k_split > kWarps ||
      (k_split & (k_split - 1)) != 0 ||
      !SkinnyFusionSupports(p, LinearCudaKernel::kSkinnyGemm)) {
    return cudaErrorInvalidValue;
  }
  return cuda::DispatchSkinnyVariant(p, Launcher{p, k_split, stream});
}

}  // namespace kernels
}  // namespace pdworker
