// What the forward derives from a model's config: the RoPE kernel's table
// parameters, the attention's softmax scale, and which CUDA features the
// model needs that have not run on a GPU yet (LlamaForward and the tests
// read them; the kernels never see a ModelConfig).
#ifndef PDWORKER_WORKER_MODEL_FORWARD_CONFIG_H_
#define PDWORKER_WORKER_MODEL_FORWARD_CONFIG_H_

#include <string>
#include <vector>

#include "worker/kernels/rope_kv_cache.h"
#include "worker/model/model_config.h"

namespace pdworker {

// The RoPE inverse-frequency table's parameters (rotary dim, base, scaling
// and its factors) for `config`'s global layers.
kernels::RopeConfig RopeConfigFor(const ModelConfig& config);

// True when every value of q and k rotates: a YaRN or LongRoPE attention
// factor is then folded into the softmax scale (q.k carries its square);
// with partial rotary the RoPE op scales cos and sin itself.
bool FoldsAttentionFactor(const ModelConfig& config);

// The attention's softmax scale: head_dim^-1/2 (Gemma 2:
// query_pre_attn_scalar^-1/2), times the folded attention factor squared.
float AttentionScale(const ModelConfig& config);

// What the CUDA kernels implement but have never run on a GPU (written
// blind; UnverifiedCudaKernels), by name (empty: nothing): the RoPE
// kernel's q/k norm and partial rotary, Gemma's layer (sandwich norms,
// GeGLU, the embedding multiplier, soft-capping in the head and the
// CUDA-core attention kernels). The fused decode epilogues and the
// megakernel implement none of it. (Windowed attention, also written blind,
// is not refused: without kAllow ModelRunner keeps sequences within the
// window on CUDA, where no mask is needed.)
std::vector<std::string> UnverifiedCudaFeatures(const ModelConfig& config);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_FORWARD_CONFIG_H_
