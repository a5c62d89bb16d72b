// Dense layer: output = input · weightᵀ (+ bias). CPU: fp32, a row-invariant
// GEMM. CUDA: cuBLAS or a skinny GEMM for decode batches, bf16 operands with
// fp32 accumulation.
#ifndef PDWORKER_WORKER_KERNELS_LINEAR_H_
#define PDWORKER_WORKER_KERNELS_LINEAR_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA
#include "worker/kernels/rope_kv_cache.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/linear_cuda.h"
#endif

namespace pdworker {
namespace kernels {

// Which GEMM computes the layer on CUDA. kAuto: a fixed table by shape class
// (kernels/linear_cuda.h): the CUDA-core skinny GEMM for a one-token decode
// batch (in_features a multiple of 8, 16-byte aligned input and weight; not
// a wide fp32-output layer of short rows: the 0.5B LM head), the
// tensor-core one for 2..8 tokens on layers of up to 4,096 outputs, cuBLAS
// otherwise. kSkinnyGemm (CUDA cores) and
// kSkinnyMma (tensor cores) run 1..8 tokens, each with rows bit-identical
// across token counts. The others force one (tests, benchmarks); the CPU
// backend has one kernel and accepts kAuto only.
enum class LinearKernel { kAuto, kCublas, kSkinnyGemm, kSkinnyMma };

// The most tokens kSkinnyGemm and kSkinnyMma run.
constexpr int kLinearSkinnyMaxTokens = 8;

// What the layer does with the product (CUDA, where a skinny GEMM runs: see
// LinearCanFuse). kSiluAndMul: `weight` is gate_up's [gate; up]
// (out_features = 2 · intermediate rows) and `output` is
// [num_tokens, intermediate] = silu(gate) · up, bit-identical to the layer
// followed by LaunchSiluAndMul. kAddResidual: `output` is the residual
// stream, read and overwritten with bf16(output + bf16(x·w + b)),
// bit-identical to the layer followed by the residual add of
// LaunchFusedAddRmsNorm. kRopeKvCache: `output` is a fused qkv projection
// and `rope` describes exactly its rows (query, key and value: the output's
// column slices at 0, q and q + kv, row strides out_features); the layer
// then does what LaunchRopeKvCache(rope) does, bit for bit. One kernel
// instead of two.
enum class LinearEpilogue { kNone, kSiluAndMul, kAddResidual, kRopeKvCache };

// What the layer does with its input first (CUDA, where a skinny GEMM runs).
// kRmsNorm: `input` is the pre-norm residual stream and the layer multiplies
// RMSNorm(input; norm_weight, norm_epsilon), bit-identical to LaunchRmsNorm
// followed by the layer (the normalized rows are never written out).
enum class LinearPrologue { kNone, kRmsNorm };

struct LinearParams {
  DeviceBuffer input;  // [>= num_tokens, in_features] of `dtype`
  // [out_features, in_features] of `dtype`: the Hugging Face nn.Linear
  // layout, so safetensors weights are used as stored. Fused projections
  // (q|k|v, or gate|up for silu_and_mul) are row blocks concatenated along
  // out_features.
  DeviceBuffer weight;
  DeviceBuffer bias;    // [out_features] of `dtype`, or empty for no bias
  DeviceBuffer output;  // [>= num_tokens, out_features] of `output_dtype`;
                        // must not overlap input, weight or bias
  int num_tokens = 0;   // padded rows computed (all of them, padding included)
  int in_features = 0;
  int out_features = 0;
  // input, weight and bias: fp32 on the CPU backend, bf16 on CUDA.
  DType dtype = DType::kFloat32;
  // fp32 on the CPU backend; bf16 or fp32 (the LM head's logits) on CUDA.
  DType output_dtype = DType::kFloat32;
  LinearKernel kernel = LinearKernel::kAuto;
  LinearEpilogue epilogue = LinearEpilogue::kNone;
  LinearPrologue prologue = LinearPrologue::kNone;
  DeviceBuffer norm_weight = {};  // kRmsNorm: [in_features] of `dtype`
  float norm_epsilon = 0.0f;      // kRmsNorm
  RopeKvCacheParams rope = {};    // kRopeKvCache
};

// True when p's prologue and epilogue, as set, can run on `stream`: CUDA, a
// skinny GEMM chosen for p (kAuto at one token, or forced), in_features a
// multiple of 8, 16-byte aligned input and weight, bf16 output, and
// kernels::SkinnyFusionSupports's conditions (kSiluAndMul: even
// out_features; kRmsNorm: a 16-byte aligned norm_weight and num_tokens ·
// (in_features + 8) · 2 <= 36 KiB, with kNone or kSiluAndMul; kAddResidual
// without a prologue; on the CUDA-core kernel both at one token). Always
// true for kNone / kNone. The caller runs the separate kernels otherwise.
bool LinearCanFuse(const Stream& stream, const LinearParams& p);

// CPU: a row-invariant GEMM (see linear.cc): row t of the output is
// bit-identical whatever num_tokens is, so an eager run at the real token
// count and a graph replayed at the padded count agree bit for bit.
// CUDA, 1 token: the skinny GEMM (skinny_gemm.cu; row-invariant over 1..8
// tokens when forced, as is the tensor-core one, skinny_gemm_mma.cu). CUDA,
// more tokens: cublasGemmEx (CUBLAS_COMPUTE_32F) on the stream's handle and
// fixed workspace. Deterministic for a given shape, but cuBLAS picks its
// algorithm per shape, so row t may differ in the last bits between token
// counts (graph at the padded count vs eager at the real one).
absl::Status LaunchLinear(Stream& stream, const LinearParams& p);

#if PDW_HAVE_CUDA
// What LaunchLinear checks on a CUDA stream, and the params it would launch
// with (kernels that run a layer inside a bigger kernel take these; the
// skinny GEMM's split is SkinnyGemmKSplit of the shape).
absl::StatusOr<LinearCudaParams> ResolveLinearCuda(const Stream& stream,
                                                   const LinearParams& p);
#endif

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LINEAR_H_
