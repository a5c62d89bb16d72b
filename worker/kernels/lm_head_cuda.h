// CUDA launchers of gather_rows (worker/kernels/lm_head.h), bf16 rows, and
// of the one-row LM head that folds its logits for the greedy sampler. The
// LM head's GEMM is otherwise the linear op's, with fp32 output.
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_
#define PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {
namespace kernels {

struct GatherRowsCudaParams {
  const __nv_bfloat16* input = nullptr;  // [num_input_rows, row_size]
  const int32_t* indices = nullptr;      // [num_indices], read on device
  __nv_bfloat16* output = nullptr;       // [num_indices, row_size]
  int num_input_rows = 0;
  int num_indices = 0;
  int row_size = 0;
};

// One block per output row. Returns the launch error.
// Gemma 2's final logit soft-capping in place: logits[i] = cap *
// tanh(logits[i] / cap) over `count` fp32 logits (the CPU kernel's
// expression). Written without a GPU (UnverifiedCudaKernels).
cudaError_t LaunchLogitSoftcapCuda(float* logits, int64_t count, float cap,
                                   cudaStream_t stream);

cudaError_t LaunchGatherRowsCuda(const GatherRowsCudaParams& p,
                                 cudaStream_t stream);

// One row's logits = hidden · weightᵀ (fp32, bit-identical to the CUDA-core
// skinny GEMM at one token: LinearCudaKernel::kSkinnyGemm) and its
// greedy tile folds (greedy_fold.cuh), which the greedy sampler combines
// instead of reading the logits (SamplingCudaParams::greedy_tiles).
struct GreedyHeadCudaParams {
  const __nv_bfloat16* hidden = nullptr;  // [in_features], the normed row
  const __nv_bfloat16* weight = nullptr;  // [vocab_size, in_features]
  float* logits = nullptr;                // [vocab_size]
  void* tiles = nullptr;  // GreedyTilesCudaBytes(1) bytes (sampling_cuda.h)
  int in_features = 0;
  int vocab_size = 0;
  // Or null. Set: `hidden` is the pre-norm residual stream
  // [num_input_rows, in_features], and the head multiplies
  // RMSNorm(hidden[*row_index]; norm_weight, norm_epsilon) (a zero row for
  // an index outside [0, num_input_rows)), bit for bit the row the
  // gathering RMSNorm kernel (rms_norm_cuda.h, row_indices) would write:
  // the step's final norm in the head's prologue.
  const __nv_bfloat16* norm_weight = nullptr;  // [in_features]
  float norm_epsilon = 0.0f;
  const int32_t* row_index = nullptr;  // [1], read on the device
  int num_input_rows = 0;
};

// The widest row the norm prologue takes: the RMSNorm kernel's vectorized
// path (at most 4 16-byte vectors per thread of 256), whose bits it
// reproduces.
inline constexpr int kGreedyHeadNormMaxFeatures = 8192;

// in_features a multiple of 8, hidden and weight 16-byte aligned, tiles
// 4-byte aligned, and a tile's logits (and the normalized row) within the
// kernel's shared memory (vocabularies up to ~5M ids); with the norm, a
// 16-byte aligned norm_weight, a row_index, and in_features <=
// kGreedyHeadNormMaxFeatures.
bool GreedyHeadCudaSupports(const GreedyHeadCudaParams& p);

// cudaErrorInvalidValue where GreedyHeadCudaSupports(p) is false.
cudaError_t LaunchGreedyHeadCuda(const GreedyHeadCudaParams& p,
                                 cudaStream_t stream);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LM_HEAD_CUDA_H_
