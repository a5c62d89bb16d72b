// Dense layer on CUDA: output = input · weightᵀ (+ bias) through cuBLAS,
// bf16 operands with fp32 accumulation (CUBLAS_COMPUTE_32F), or through the
// skinny GEMMs (skinny_gemm.cu, skinny_gemm_mma.cu) for decode batches.
#include <cublasLt.h>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/linear_cuda.h"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// grid: [num_tokens, ceil(out_features / kThreads)]. Writes the bias into
// every fp32 output row, so that the GEMM with beta = 1 adds it inside its
// fp32 epilogue: one rounding of (x·w + b), as the CPU kernel computes it.
__global__ void BroadcastBiasKernel(const __nv_bfloat16* __restrict__ bias,
                                    float* __restrict__ output,
                                    int out_features) {
  const int o = blockIdx.y * blockDim.x + threadIdx.x;
  if (o >= out_features) return;
  output[static_cast<int64_t>(blockIdx.x) * out_features + o] =
      cuda::ToFloat(bias[o]);
}

// Row-major Y[T, O] = X[T, I] · W[O, I]ᵀ is column-major Yᵀ[O, T] =
// op(W)[O, I] · Xᵀ[I, T] where the row-major W buffer read column-major is
// Wᵀ [I, O] (lda = I), hence CUBLAS_OP_T on it; X read column-major is
// Xᵀ [I, T] (ldb = I); Yᵀ is [O, T] column-major (ldc = O).

// bf16 output with a bias: cuBLASLt's BIAS epilogue adds the bias to the
// fp32 accumulator before the single rounding to bf16. (cublasGemmEx with a
// bf16 C and beta = 1 rounds x·w to bf16 before adding C on the H100: for a
// bias that cancels most of x·w the result was off by several bf16 ulps.)
// The descriptors are the stack-allocated opaque kind (no host allocation);
// algo = nullptr lets cublasLtMatmul run its heuristic, and no workspace is
// passed, so the call never allocates and is capturable.
cublasStatus_t BiasedBf16Gemm(const LinearCudaParams& p, cudaStream_t stream,
                              cublasHandle_t cublas) {
  // A cuBLAS handle is documented to be usable as a cuBLASLt handle.
  cublasLtHandle_t lt = reinterpret_cast<cublasLtHandle_t>(cublas);
  cublasLtMatmulDescOpaque_t desc;
  cublasStatus_t s =
      cublasLtMatmulDescInit(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  const cudaDataType_t bias_type = CUDA_R_16BF;
  const void* bias = p.bias;
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value,
                 size_t size) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulDescSetAttribute(&desc, attribute, value, size);
    }
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  cublasLtMatrixLayoutOpaque_t a, b, d;
  s = cublasLtMatrixLayoutInit(&a, CUDA_R_16BF, p.in_features, p.out_features,
                               p.in_features);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutInit(&b, CUDA_R_16BF, p.in_features, p.num_tokens,
                                 p.in_features);
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutInit(&d, CUDA_R_16BF, p.out_features, p.num_tokens,
                                 p.out_features);
  }
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(lt, &desc, &alpha, p.weight, &a, p.input, &b, &beta,
                        p.output, &d, p.output, &d, /*algo=*/nullptr,
                        /*workspace=*/nullptr, 0, stream);
}

// The one-token layers kAuto leaves to cuBLAS although the skinny GEMM
// could run them (linear_cuda.h's table): fp32 output, unfused, more than
// kSkinnyAutoMaxNarrowOutFeatures outputs, fewer than kSkinnyGemmAutoLongRow
// inputs.
bool SkinnyGemmAutoPrefersCublas(const LinearCudaParams& p) {
  return p.output_type == LinearCudaOutput::kFloat32 &&
         p.prologue == LinearCudaPrologue::kNone &&
         p.epilogue == LinearCudaEpilogue::kNone &&
         p.out_features > kSkinnyAutoMaxNarrowOutFeatures &&
         p.in_features < kSkinnyGemmAutoLongRow;
}

}  // namespace

LinearCudaKernel ChosenLinearCudaKernel(const LinearCudaParams& p) {
  if (p.kernel != LinearCudaKernel::kAuto) return p.kernel;
  if (p.num_tokens <= kSkinnyGemmAutoMaxTokens && SkinnyGemmSupports(p) &&
      !SkinnyGemmAutoPrefersCublas(p)) {
    return LinearCudaKernel::kSkinnyGemm;
  }
  if (p.num_tokens >= kSkinnyMmaAutoMinTokens &&
      p.num_tokens <= kSkinnyMmaAutoMaxTokens &&
      p.out_features <= kSkinnyAutoMaxNarrowOutFeatures &&
      SkinnyMmaSupports(p)) {
    return LinearCudaKernel::kSkinnyMma;
  }
  return LinearCudaKernel::kCublas;
}

bool SkinnyFusionSupports(const LinearCudaParams& p, LinearCudaKernel kernel) {
  using E = LinearCudaEpilogue;
  const bool bf16_out = p.output_type == LinearCudaOutput::kBFloat16;
  const bool norm = p.prologue == LinearCudaPrologue::kRmsNorm;
  const bool one_token_only = kernel == LinearCudaKernel::kSkinnyGemm;
  switch (p.epilogue) {
    case E::kNone:
      break;
    case E::kSiluAndMul:
      if (!bf16_out || p.out_features % 2 != 0) return false;
      break;
    case E::kAddResidual:
      if (!bf16_out || norm || (one_token_only && p.num_tokens != 1)) {
        return false;
      }
      break;
    case E::kRopeKvCache: {
      const RopeKvCacheCudaParams& r = p.rope;
      if (!bf16_out || (one_token_only && p.num_tokens != 1) ||
          r.head_dim <= 0 || r.head_dim % 2 != 0 || r.num_heads <= 0 ||
          r.num_kv_heads <= 0 ||
          p.out_features != (r.num_heads + 2 * r.num_kv_heads) * r.head_dim) {
        return false;
      }
      break;
    }
  }
  if (!norm) return true;
  const int64_t normed_bytes = int64_t{2} * p.num_tokens * (p.in_features + 8);
  return bf16_out && p.norm_weight != nullptr &&
         cuda::Aligned16(p.norm_weight) &&
         normed_bytes <= kSkinnyNormMaxBytes &&
         (!one_token_only || p.num_tokens == 1);
}

LinearCudaResult LaunchLinearCuda(const LinearCudaParams& p,
                                  cudaStream_t stream, cublasHandle_t cublas) {
  LinearCudaResult result;
  switch (ChosenLinearCudaKernel(p)) {
    case LinearCudaKernel::kSkinnyGemm:
      result.launch = LaunchSkinnyGemmCuda(
          p, SkinnyGemmKSplit(p.in_features, p.out_features), stream);
      return result;
    case LinearCudaKernel::kSkinnyMma:
      result.launch = LaunchSkinnyMmaCuda(
          p, SkinnyMmaKSplit(p.in_features, p.out_features), stream);
      return result;
    case LinearCudaKernel::kAuto:
    case LinearCudaKernel::kCublas:
      break;
  }
  if (p.epilogue != LinearCudaEpilogue::kNone ||
      p.prologue != LinearCudaPrologue::kNone) {
    result.launch = cudaErrorInvalidValue;  // cuBLAS has no such fusion
    return result;
  }
  const bool fp32_out = p.output_type == LinearCudaOutput::kFloat32;
  if (p.bias != nullptr && !fp32_out) {
    result.cublas = BiasedBf16Gemm(p, stream, cublas);
    return result;
  }
  float beta = 0.0f;
  if (p.bias != nullptr) {  // fp32 output: bias first, then C += x·w
    const dim3 grid(p.num_tokens, cuda::NumBlocks(p.out_features, kThreads));
    BroadcastBiasKernel<<<grid, kThreads, 0, stream>>>(
        p.bias, static_cast<float*>(p.output), p.out_features);
    result.launch = cudaGetLastError();
    if (result.launch != cudaSuccess) return result;
    beta = 1.0f;
  }
  // alpha and beta are host scalars: cuBLAS reads them at enqueue time (and
  // bakes them into a captured graph). The algorithm is cuBLAS's heuristic
  // for (O, T, I): deterministic for a given shape, possibly different across
  // token counts.
  const float alpha = 1.0f;
  result.cublas =
      cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.out_features,
                   p.num_tokens, p.in_features, &alpha, p.weight, CUDA_R_16BF,
                   p.in_features, p.input, CUDA_R_16BF, p.in_features, &beta,
                   p.output, fp32_out ? CUDA_R_32F : CUDA_R_16BF,
                   p.out_features, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return result;
}

}  // namespace kernels
}  // namespace pdworker
