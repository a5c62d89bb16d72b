// RMSNorm and fused residual-add + RMSNorm on CUDA (bf16, fp32 statistics).
#include <cstdint>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/rms_norm_cuda.h"
#include "worker/kernels/rms_norm_row.cuh"

namespace pdworker {
namespace kernels {
namespace {

using cuda::Aligned16;
using cuda::Bf16x8ToFloat;
using cuda::BlockSum;
using cuda::FromFloat;
using cuda::ToFloat;

// The vectorized kernel's order is the one rms_norm_row.cuh defines (the
// skinny GEMMs' RMSNorm prologue reproduces it bit for bit).
constexpr int kThreads = cuda::kRmsNormThreads;

// Output row blockIdx.x's input row, or -1 for a zero row (a gather index
// outside [0, num_input_rows)).
__device__ __forceinline__ int64_t InputRow(const int32_t* row_indices,
                                            int num_input_rows) {
  if (row_indices == nullptr) return blockIdx.x;
  const int32_t index = row_indices[blockIdx.x];
  return index >= 0 && index < num_input_rows ? index : -1;
}

// grid: [num_tokens]; block: kThreads. Each thread owns the elements
// i ≡ threadIdx.x (mod kThreads) of the row in both passes, so `output` may
// alias `input` (or be written over elements the same thread read) and the
// second pass re-reads the residual values this very thread stored. When
// gathering, the residual is not stored: the second pass recomputes the
// rounded sum (the same bits).
__global__ void RmsNormKernel(const __nv_bfloat16* input,
                              __nv_bfloat16* residual,
                              const __nv_bfloat16* __restrict__ weight,
                              __nv_bfloat16* output, int hidden_size,
                              float epsilon, const int32_t* row_indices,
                              int num_input_rows) {
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();  // launched with kProgrammatic
  __shared__ float scratch[32];
  const int64_t in_row = InputRow(row_indices, num_input_rows);
  __nv_bfloat16* out = output + static_cast<int64_t>(blockIdx.x) * hidden_size;
  if (in_row < 0) {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      out[i] = FromFloat<__nv_bfloat16>(0.0f);
    }
    return;
  }
  const int64_t row = in_row * hidden_size;
  const __nv_bfloat16* x = input + row;
  const bool store = row_indices == nullptr;
  // The residual-updated value of element i, as stored (rounded to bf16).
  auto updated = [&](int i) {
    return FromFloat<__nv_bfloat16>(ToFloat(residual[row + i]) + ToFloat(x[i]));
  };

  // Pass 1: sum of squares (and, fused, the residual update).
  float sum_squares = 0.0f;
  if (residual == nullptr) {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      const float v = ToFloat(x[i]);
      sum_squares += v * v;
    }
  } else {
    for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
      const __nv_bfloat16 u = updated(i);
      if (store) residual[row + i] = u;
      const float v = ToFloat(u);
      sum_squares += v * v;
    }
  }
  sum_squares = BlockSum(sum_squares, scratch);
  // 1/sqrt with IEEE sqrt and division (not rsqrtf's approximation): closer
  // to the CPU kernel's double-precision statistic.
  const float inv_rms =
      1.0f / sqrtf(sum_squares / static_cast<float>(hidden_size) + epsilon);

  // Pass 2: normalize. The fused variant normalizes the updated residual.
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    const float v = residual == nullptr ? ToFloat(x[i])
                    : store             ? ToFloat(residual[row + i])
                                        : ToFloat(updated(i));
    out[i] = FromFloat<__nv_bfloat16>(v * inv_rms * ToFloat(weight[i]));
  }
}

// The same math in one pass (rms_norm_row.cuh's order) for rows of hidden_size
// % 8 == 0 elements and at most kVecs · kThreads 16-byte vectors: thread i
// holds vectors i, i + kThreads, ... in registers between the statistic and the
// normalization, so each element is read once (the two-pass kernel reads it
// twice, and re-reads the residual it just stored). In place is fine for the
// same reason as above: a thread writes only the vectors it read.
template <int kVecs>
__global__ void __launch_bounds__(kThreads)
    RmsNormVecKernel(const __nv_bfloat16* input, __nv_bfloat16* residual,
                     const __nv_bfloat16* __restrict__ weight,
                     __nv_bfloat16* output, int hidden_size, float epsilon,
                     const int32_t* row_indices, int num_input_rows) {
  cuda::AllowDependentLaunch();
  cuda::WaitForPreviousKernel();  // launched with kProgrammatic
  __shared__ float scratch[32];
  const int vectors = hidden_size / 8;
  const int64_t in_row = InputRow(row_indices, num_input_rows);
  uint4* out = reinterpret_cast<uint4*>(
      output + static_cast<int64_t>(blockIdx.x) * hidden_size);
  if (in_row < 0) {
    for (int i = threadIdx.x; i < vectors; i += kThreads) {
      out[i] = make_uint4(0, 0, 0, 0);  // bf16 +0.0 is all zero bits
    }
    return;
  }
  const bool store = row_indices == nullptr;
  const int64_t row = in_row * hidden_size;
  const uint4* x = reinterpret_cast<const uint4*>(input + row);
  uint4* res =
      residual == nullptr ? nullptr : reinterpret_cast<uint4*>(residual + row);
  float v[kVecs][8];
  float sum_squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = threadIdx.x + k * kThreads;
    if (i >= vectors) break;
    Bf16x8ToFloat(x[i], v[k]);
    if (res != nullptr) {
      float r[8];
      Bf16x8ToFloat(res[i], r);
#pragma unroll
      for (int e = 0; e < 8; ++e) r[e] += v[k][e];
      // the norm sees the rounded residual
      const uint4 updated = cuda::PackBf16x8(r);
      if (store) res[i] = updated;
      Bf16x8ToFloat(updated, v[k]);
    }
    sum_squares = cuda::AddSquares(v[k], sum_squares);
  }
  const float inv_rms =
      cuda::InvRms(BlockSum(sum_squares, scratch), hidden_size, epsilon);
  const uint4* w = reinterpret_cast<const uint4*>(weight);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = threadIdx.x + k * kThreads;
    if (i >= vectors) break;
    out[i] = cuda::NormalizeBf16x8(v[k], inv_rms, w[i]);
  }
}

}  // namespace

cudaError_t LaunchRmsNormCuda(const RmsNormCudaParams& p, cudaStream_t stream) {
  const int vectors = p.hidden_size / 8;
  const bool vectorized = p.hidden_size % 8 == 0 && Aligned16(p.input) &&
                          Aligned16(p.weight) && Aligned16(p.output) &&
                          (p.residual == nullptr || Aligned16(p.residual));
  // Programmatic dependent launch: scheduled while the previous kernel (a
  // projection, in a decode step) drains; the kernel waits for it first.
  const auto launch = [&](auto kernel) {
    return cuda::LaunchKernel(
        kernel, dim3(p.num_tokens), dim3(kThreads), 0, stream,
        cuda::DependentLaunch::kProgrammatic, p.input, p.residual, p.weight,
        p.output, p.hidden_size, p.epsilon, p.row_indices, p.num_input_rows);
  };
  if (vectorized && vectors <= kThreads) return launch(RmsNormVecKernel<1>);
  if (vectorized && vectors <= 2 * kThreads) {
    return launch(RmsNormVecKernel<2>);
  }
  if (vectorized && vectors <= 4 * kThreads) {
    return launch(RmsNormVecKernel<4>);
  }
  return launch(RmsNormKernel);
}

}  // namespace kernels
}  // namespace pdworker
