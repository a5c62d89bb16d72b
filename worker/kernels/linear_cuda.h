// CUDA launchers of the dense layer (worker/kernels/linear.h): cuBLAS GEMM,
// or the skinny GEMM for decode batches; bf16 inputs, fp32 accumulation,
// bf16 or fp32 output.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_
#define PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "worker/kernels/rope_kv_cache_cuda.h"

namespace pdworker {
namespace kernels {

enum class LinearCudaOutput { kBFloat16, kFloat32 };

// Which GEMM computes the layer. kAuto: the CUDA-core skinny GEMM
// (skinny_gemm.cu) for kSkinnyGemmAutoMaxTokens tokens when the shape allows
// it (SkinnyGemmSupports), unless it is a wide LM head of short rows; the
// tensor-core skinny GEMM for 2..8 tokens on narrow layers; cuBLAS
// otherwise (ChosenLinearCudaKernel; the table is below).
// kSkinnyMma: the tensor-core skinny GEMM (skinny_gemm_mma.cu), 1..8 tokens.
enum class LinearCudaKernel { kAuto, kCublas, kSkinnyGemm, kSkinnyMma };

// What the skinny GEMMs do with their result. kSiluAndMul: the weight is
// [gate; up] (out_features = 2 · intermediate rows) and the bf16 output is
// [num_tokens, intermediate] = silu(gate) · up, bit-identical to the GEMM
// followed by the SiLU-and-mul kernel. kAddResidual: the bf16 output is the
// residual stream, read and overwritten: output = bf16(output + bf16(x·w +
// b)), bit-identical to the GEMM followed by the residual add of the fused
// add + RMSNorm kernel. kRopeKvCache: the output is a fused qkv projection
// [num_tokens, (heads + 2 · kv_heads) · head_dim]; q and k are rotated in
// place and k and v written to the KV cache (`rope`), bit-identical to the
// GEMM followed by the RoPE + KV-cache kernel. cuBLAS runs kNone only.
enum class LinearCudaEpilogue {
  kNone,
  kSiluAndMul,
  kAddResidual,
  kRopeKvCache
};

// What the skinny GEMMs do with their input first. kRmsNorm: `input` is the
// pre-norm residual stream and the GEMM multiplies RMSNorm(input) ·
// norm_weight, computed per CTA in shared memory with the RMSNorm kernel's
// arithmetic (rms_norm_row.cuh), so bit-identical to the RMSNorm kernel
// followed by the GEMM. cuBLAS runs kNone only.
enum class LinearCudaPrologue { kNone, kRmsNorm };

// The most bytes of normalized input a kRmsNorm prologue keeps in shared
// memory, num_tokens · (in_features + 8) · 2 (rows padded by 16 bytes for
// the tensor-core kernel's bank spread): with the kernels' static shared
// memory (<= 8.2 KiB) it stays under the 48 KiB a launch gets without an
// opt-in attribute. 8 tokens of a 2,048-wide hidden state fit.
constexpr int kSkinnyNormMaxBytes = 36 * 1024;

// kAuto's table, by shape class (ChosenLinearCudaKernel), from the second
// H200 run of linear_bench (2026-11-27, bench/RESULTS.md; µs per layer,
// weights cold, each skinny GEMM launched with PDL):
//  - 1 token: the CUDA-core skinny GEMM (1.13-1.96x cuBLAS on the
//    projections of 3,072 or fewer outputs, a tie on the 1B qkv at 6.2; the
//    1B LM head 124.48 vs 126.16), except an LM head (fp32 logits, unfused) of
//    more than kSkinnyAutoMaxNarrowOutFeatures outputs whose rows are shorter
//    than kSkinnyGemmAutoLongRow inputs: the 0.5B one, 896→151,936, is 67.87 on
//    cuBLAS vs 80.38. cuBLAS also led on the wide projections run unfused
//    (gate_up: 0.5B 6.91 vs 7.20, 1B 17.98 vs 19.91), but those keep the
//    skinny GEMM: the decode fusion runs them fused on it, and the unfused
//    sequence must give the fused one's bits (DecodeFusion).
//  - 2..8 tokens: the tensor-core skinny GEMM on layers of at most
//    kSkinnyAutoMaxNarrowOutFeatures outputs (qkv 1.03-1.40x cuBLAS, o_proj
//    1.14-1.66x, down 1.03-1.12x on both shapes), cuBLAS on wider ones
//    (gate_up 0.78-0.88x, LM heads 0.93-0.99x on the tensor-core kernel).
//  - more tokens: cuBLAS.
// Every class is closed under padding (1 is a capture size; 2..8 pad
// within 2..8), so a row's kernel, and its bits, never depend on padding.
constexpr int kSkinnyGemmMaxTokens = 8;
constexpr int kSkinnyGemmAutoMaxTokens = 1;
constexpr int kSkinnyAutoMaxNarrowOutFeatures = 4096;
constexpr int kSkinnyGemmAutoLongRow = 2048;
constexpr int kSkinnyMmaAutoMinTokens = 2;
constexpr int kSkinnyMmaAutoMaxTokens = 8;

struct LinearCudaParams {
  const __nv_bfloat16* input = nullptr;   // [num_tokens, in_features]
  const __nv_bfloat16* weight = nullptr;  // [out_features, in_features]
  const __nv_bfloat16* bias = nullptr;    // [out_features] or nullptr
  void* output = nullptr;  // [num_tokens, out_features] of output_type
  LinearCudaOutput output_type = LinearCudaOutput::kBFloat16;
  int num_tokens = 0;
  int in_features = 0;
  int out_features = 0;
  LinearCudaKernel kernel = LinearCudaKernel::kAuto;
  LinearCudaEpilogue epilogue = LinearCudaEpilogue::kNone;
  LinearCudaPrologue prologue = LinearCudaPrologue::kNone;
  const __nv_bfloat16* norm_weight = nullptr;  // [in_features], kRmsNorm
  float norm_epsilon = 0.0f;                   // kRmsNorm
  // kRopeKvCache: positions, slot_mapping, inv_freq, the caches, heads,
  // kv heads, head_dim and num_slots (query / key / value are the output's
  // rows and are not read).
  RopeKvCacheCudaParams rope;
  // Skinny GEMMs only: launch with programmatic stream serialization, so it
  // may start (and issue its weight loads) before the previous kernel ends;
  // it reads the input only after griddepcontrol.wait.
  bool programmatic_launch = true;
};

// What went wrong, if anything: the bias broadcast kernel's launch error and
// cuBLAS's status.
struct LinearCudaResult {
  cudaError_t launch = cudaSuccess;
  cublasStatus_t cublas = CUBLAS_STATUS_SUCCESS;
};

// The kernel LaunchLinearCuda runs `p` on: kCublas, kSkinnyGemm or
// kSkinnyMma (never kAuto). A forced skinny kernel is returned as is, even
// where it cannot run (the launch then fails with cudaErrorInvalidValue).
LinearCudaKernel ChosenLinearCudaKernel(const LinearCudaParams& p);

// The skinny GEMM's split-K factor (1, 2, 4 or 8) for a weight shape: a
// function of the shape alone, so a row's reduction order is too.
int SkinnyGemmKSplit(int in_features, int out_features);

// True when the skinny GEMM can run `p`: 1..8 tokens, in_features a multiple
// of 8, input and weight 16-byte aligned (bias and output need no alignment).
bool SkinnyGemmSupports(const LinearCudaParams& p);

// True when `kernel` (kSkinnyGemm or kSkinnyMma) can run p's prologue and
// epilogue: kNone / kNone always; kSiluAndMul: bf16 output, even
// out_features; kAddResidual: bf16 output, no prologue; kRopeKvCache: bf16
// output, out_features = (heads + 2 · kv_heads) · head_dim, head_dim even;
// kRmsNorm: bf16
// output, a 16-byte aligned norm_weight, num_tokens · (in_features + 8) · 2
// <= kSkinnyNormMaxBytes, with the epilogue kNone, kSiluAndMul or
// kRopeKvCache. The CUDA-core kernel runs kRmsNorm, kAddResidual and
// kRopeKvCache at one token only.
bool SkinnyFusionSupports(const LinearCudaParams& p, LinearCudaKernel kernel);

// The skinny GEMM with an explicit split-K factor (benchmarks sweep it;
// LaunchLinearCuda uses SkinnyGemmKSplit). cudaErrorInvalidValue when
// SkinnyGemmSupports(p) is false or k_split is not 1, 2, 4 or 8.
cudaError_t LaunchSkinnyGemmCuda(const LinearCudaParams& p, int k_split,
                                 cudaStream_t stream);

// The tensor-core skinny GEMM's split-K factor (1, 2, 4 or 8): a function
// of the shape alone.
int SkinnyMmaKSplit(int in_features, int out_features);

// True when the tensor-core skinny GEMM can run `p`: the same conditions as
// SkinnyGemmSupports (1..8 tokens, in_features % 8 == 0, 16-byte aligned
// input and weight); the device must be sm_80 or newer.
bool SkinnyMmaSupports(const LinearCudaParams& p);

// The tensor-core skinny GEMM with an explicit split-K factor. Same
// epilogues, outputs and refusals as LaunchSkinnyGemmCuda.
cudaError_t LaunchSkinnyMmaCuda(const LinearCudaParams& p, int k_split,
                                cudaStream_t stream);

// `cublas` must be bound to `stream` with a fixed workspace (CudaStream does
// both), so the call is capturable and never allocates.
LinearCudaResult LaunchLinearCuda(const LinearCudaParams& p,
                                  cudaStream_t stream, cublasHandle_t cublas);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LINEAR_CUDA_H_
