// The model's output head: logits only for the rows that are sampled (the
// last query token of each request), not for every token of the step.
// The final RMSNorm before it is rms_norm.
#ifndef PDWORKER_WORKER_KERNELS_LM_HEAD_H_
#define PDWORKER_WORKER_KERNELS_LM_HEAD_H_

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/kernels/linear.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// output[i] = input[indices[i]] for i < num_indices; an index outside
// [0, num_input_rows) (e.g. −1 for a padding request) gives a zero row.
// `indices` is read at run time.
struct GatherRowsParams {
  DeviceBuffer input;    // [>= num_input_rows, row_size] of `dtype`
  DeviceBuffer indices;  // int32 [>= num_indices]
  DeviceBuffer output;   // [>= num_indices, row_size] of `dtype`; must not
                         // overlap input
  int num_input_rows = 0;
  int num_indices = 0;
  int row_size = 0;
  DType dtype = DType::kFloat32;  // fp32 on the CPU backend, bf16 on CUDA
};

absl::Status LaunchGatherRows(Stream& stream, const GatherRowsParams& p);

// logits[i] = hidden[logits_indices[i]] · weightᵀ for i < num_rows:
// gather_rows into `gathered`, then one GEMM (linear) of num_rows rows. The
// logits are fp32 on both backends (on CUDA: bf16 operands, fp32
// accumulation and fp32 output, so sampling sees unrounded logits).
// num_rows is the padded request count of the captured batch; the runner
// fills logits_indices for padding requests with −1 (zero logits) or any
// valid row, and samples only the real ones.
// With `logits_indices` empty there is no gather: `hidden` already holds
// the num_rows rows (the final norm gathered them: RmsNormParams::
// row_indices), one kernel fewer per step.
struct LmHeadParams {
  DeviceBuffer hidden;          // [>= num_tokens, hidden_size], normed
  DeviceBuffer logits_indices;  // int32 [>= num_rows]: each request's last
                                // query row (query_start_loc[r + 1] − 1),
                                // or empty (no gather)
  DeviceBuffer gathered;        // [>= num_rows, hidden_size] scratch; unused
                                // without a gather
  // [vocab_size, hidden_size] (lm_head.weight, or embed_tokens.weight when
  // tie_word_embeddings).
  DeviceBuffer weight;
  DeviceBuffer logits;  // fp32 [>= num_rows, vocab_size]
  int num_tokens = 0;   // padded token rows of `hidden`
  int num_rows = 0;     // padded request count (<= max_num_seqs)
  int hidden_size = 0;
  int vocab_size = 0;
  // Element type of hidden, gathered and weight: fp32 on the CPU backend,
  // bf16 on CUDA.
  DType dtype = DType::kFloat32;
  LinearKernel linear_kernel = LinearKernel::kAuto;  // the projection's GEMM
  // Or empty. GreedyTilesBytes(1) bytes (sampling.h), 4-byte aligned: the
  // one row's greedy tile folds, written with its logits by one kernel
  // (lm_head_greedy.cu), for SamplingParams::greedy_tiles. Only where
  // LmHeadWritesGreedyTiles(stream, p); refused elsewhere.
  DeviceBuffer greedy_tiles;
  // Or empty; only with greedy_tiles and no logits_indices. `hidden` is then
  // the pre-norm residual stream [num_tokens, hidden_size] and the head
  // normalizes its one row, hidden[norm_row_index[0]] (an index outside
  // [0, num_tokens): a zero row), with RMSNorm(norm_weight, norm_epsilon)
  // itself, bit for bit the row the gathering RMSNorm (rms_norm.h,
  // row_indices) writes: the final norm and the head in one kernel.
  DeviceBuffer norm_weight;  // [hidden_size]
  float norm_epsilon = 0.0f;
  DeviceBuffer norm_row_index;  // int32 [>= 1], read on the device
  // Gemma 2's final_logit_softcapping: each logit x becomes
  // softcap * tanh(x / softcap); 0 means none. On CUDA a kernel after the
  // head's GEMM (no greedy tiles then), written without a GPU
  // (UnverifiedCudaKernels).
  float softcap = 0.0f;
};

// True when LaunchLmHead(stream, p) can write p.greedy_tiles: they are set,
// on CUDA, for one bf16 row (num_rows == 1) under LinearKernel kAuto or
// kSkinnyGemm, hidden_size a multiple of 8, the rows and weight 16-byte
// aligned; with norm_weight, no logits_indices, a 16-byte aligned
// norm_weight and hidden_size <= 8,192. The logits then carry the CUDA-core
// skinny GEMM's bits wherever its split-K is 1 (vocabularies of 4,096 ids or
// more, rows of up to 768): kAuto's own choice at one row, except for a wide
// head of short rows, where the fused head takes the place of cuBLAS (the 0.5B
// one). Either way the choice is a function of the step's shape, as graph
// replay against eager needs.
bool LmHeadWritesGreedyTiles(const Stream& stream, const LmHeadParams& p);

absl::Status LaunchLmHead(Stream& stream, const LmHeadParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_LM_HEAD_H_
