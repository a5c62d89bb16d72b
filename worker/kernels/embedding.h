// Token embedding lookup: out[t, :] = table[token_ids[t], :].
#ifndef PDWORKER_WORKER_KERNELS_EMBEDDING_H_
#define PDWORKER_WORKER_KERNELS_EMBEDDING_H_

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

struct EmbeddingParams {
  // int32 [>= num_tokens]; read at run time (a captured graph sees each
  // step's ids). Padding tokens carry id 0. An id outside [0, vocab_size)
  // yields a zero row: requests are validated against the vocabulary at the
  // RPC boundary, so this only keeps a corrupted buffer from reading out of
  // bounds.
  DeviceBuffer token_ids;
  DeviceBuffer table;   // [vocab_size, hidden_size] of `dtype`
  DeviceBuffer output;  // [>= num_tokens, hidden_size] of `dtype`
  int num_tokens = 0;   // padded token count the op is launched (captured) for
  int vocab_size = 0;
  int hidden_size = 0;
  // Element type of table and output: fp32 on the CPU backend, bf16 on CUDA
  // (see ModelDTypeFor). The copy is exact either way.
  DType dtype = DType::kFloat32;
  // Every copied row is multiplied by this (Gemma's sqrt(hidden_size)
  // normalizer); 1 copies exactly. On CUDA bf16(float(row) * scale),
  // written without a GPU (UnverifiedCudaKernels).
  float scale = 1.0f;
};

absl::Status LaunchEmbedding(Stream& stream, const EmbeddingParams& p);

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_EMBEDDING_H_
