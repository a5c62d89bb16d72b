// Rotary position embedding (Hugging Face Llama "rotate_half" convention) on
// q and k, then the write of k and v into the paged KV cache: the first half
// of attention, which runs right before paged_attention in every layer.
#ifndef PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_H_
#define PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/rope_kv_cache_cuda.h"
#endif

namespace pdworker {
namespace kernels {

// config.json "rope_scaling.rope_type"; absent means kNone.
enum class RopeScalingType {
  kNone,      // plain RoPE: inv_freq[i] = theta^(-2i / head_dim)
  kLlama3,    // Llama 3.1+ frequency-dependent scaling (below)
  kLinear,    // position interpolation: inv_freq[i] / factor
  kYarn,      // YaRN's frequency blend (below); its attention factor is the
              // caller's (it scales the attention's softmax scale)
  kLongrope,  // LongRoPE: inv_freq[i] / pair_factors[i]
};

struct RopeConfig {
  int head_dim = 0;        // rotary dimension (the full head_dim; even)
  double theta = 10000.0;  // config.json "rope_theta"
  RopeScalingType scaling = RopeScalingType::kNone;
  // kLlama3, kLinear, kYarn: how much the (low) frequencies are slowed.
  double factor = 8.0;
  // kLlama3 only (config.json "rope_scaling"): wavelengths longer than
  // original_max_position_embeddings / low_freq_factor are slowed down by
  // `factor`, wavelengths shorter than original_max_position_embeddings /
  // high_freq_factor are kept, and the band in between is interpolated.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // kLlama3, kYarn: the pre-training context in tokens.
  int original_max_position_embeddings = 8192;
  // kYarn: pair i (of head_dim / 2) keeps theta's frequency where it turns
  // more than beta_fast times over the original context, takes freq /
  // factor where it turns fewer than beta_slow times, and blends linearly
  // in between: with d(r) = head_dim * ln(original / (2 pi r)) / (2 ln
  // theta), low = d(beta_fast), high = d(beta_slow) (floor / ceil when
  // `truncate`), clamped to [0, head_dim - 1]; ramp(i) = clamp((i - low) /
  // (high - low), 0, 1) (high += 0.001 when equal); inv_freq = freq /
  // factor * ramp + freq * (1 - ramp).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  // kLongrope: one positive divisor per pair, head_dim / 2 of them (the
  // list config.json's short_factor or long_factor the model runs).
  std::vector<double> pair_factors;
};

// INVALID_ARGUMENT naming the field when `config` is unusable (odd or too
// large head_dim, theta <= 0, llama3 factors out of range). Call this where
// the model config is parsed.
absl::Status ValidateRopeConfig(const RopeConfig& config);

// The rotation frequencies in radians per position, [head_dim / 2], computed
// once at startup and uploaded into the `inv_freq` buffer. CHECK-fails on a
// config ValidateRopeConfig rejects. Computed in double and rounded to fp32
// (Hugging Face computes in fp32; the two agree to about 1 ulp).
std::vector<float> ComputeRopeInvFreq(const RopeConfig& config);

// Per token t (all num_tokens rows, padding included):
//   0. only with q_norm_weight and k_norm_weight (Qwen3's per-head q/k norm):
//      every q head becomes x / sqrt(mean(x^2) + qk_norm_epsilon) *
//      q_norm_weight over its head_dim values (the mean in double, as the
//      CPU RMSNorm), every k head likewise with k_norm_weight, in place.
//   1. angle[i] = float(positions[t]) * inv_freq[i]  (an fp32 product, as
//      Hugging Face and vLLM compute it); for every q head and k head, pairs
//      (x[i], x[i + head_dim/2]) become
//      (x[i]·cos − x[i+h/2]·sin, x[i+h/2]·cos + x[i]·sin), in place.
//   2. slot = slot_mapping[t]; slot −1 (padding) writes nothing; otherwise
//      key_cache[slot] = k[t] (rotated) and value_cache[slot] = v[t], where
//      slot = block_id * block_size + offset indexes
//      [num_blocks * block_size] rows of [num_kv_heads, head_dim]. A slot
//      beyond the cache is skipped too (it cannot be reported from inside a
//      graph; the KV cache manager never produces one).
// positions and slot_mapping are read when the op runs, so one captured
// graph serves every step of its padded size.
struct RopeKvCacheParams {
  DeviceBuffer positions;     // int32 [>= num_tokens]
  DeviceBuffer slot_mapping;  // int32 [>= num_tokens]
  DeviceBuffer inv_freq;      // fp32 [head_dim / 2], from ComputeRopeInvFreq
  // Activations, rows of one token. q and k are rotated in place. Rows are
  // `*_row_stride` elements apart (0 means dense: num_heads * head_dim for q,
  // num_kv_heads * head_dim for k and v), so q, k and v may be column slices
  // of one fused qkv projection output [num_tokens, (H + 2·KV) · head_dim].
  DeviceBuffer query;  // [num_tokens, num_heads, head_dim]
  DeviceBuffer key;    // [num_tokens, num_kv_heads, head_dim]
  DeviceBuffer value;  // [num_tokens, num_kv_heads, head_dim]
  // One layer's cache, [num_blocks, block_size, num_kv_heads, head_dim].
  DeviceBuffer key_cache;
  DeviceBuffer value_cache;
  // Both or neither; [head_dim] in the model's dtype. The CUDA kernel's
  // norm was written without a GPU and has not run on one yet: LlamaForward
  // uses it only with UnverifiedCudaKernels::kAllow; the fused projection
  // epilogue (linear.h) refuses it.
  DeviceBuffer q_norm_weight;
  DeviceBuffer k_norm_weight;
  float qk_norm_epsilon = 0;
  // Partial rotary (Phi-4-mini): only each head's first rotary_dim values
  // rotate, as pairs (i, i + rotary_dim / 2), reading inv_freq[rotary_dim /
  // 2]; the rest are left as they are. 0: head_dim. Even. On CUDA as
  // unverified as the norm above.
  int rotary_dim = 0;
  // What cos and sin are multiplied by (a RoPE scaling's attention factor,
  // which with every value rotating the caller folds into the softmax scale
  // instead). On CUDA as unverified as the norm above.
  float rotary_scale = 1.0f;
  int num_tokens = 0;  // padded token count
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // even, <= kMaxHeadDim
  int block_size = 0;
  int num_blocks = 0;
  int query_row_stride = 0;
  int key_row_stride = 0;
  int value_row_stride = 0;
  // Element type of query, key, value and the caches: fp32 on the CPU
  // backend; bf16 on CUDA, where the rotation runs in fp32 and the rotated
  // q/k are rounded once (the cache gets exactly the rounded k).
  DType dtype = DType::kFloat32;
};

absl::Status LaunchRopeKvCache(Stream& stream, const RopeKvCacheParams& p);

// LaunchRopeKvCache's checks (each refusal names the field), without the
// launch: `p` with its row strides resolved (0 -> dense). Also what a
// projection with the fused RoPE + KV-cache epilogue checks (linear.h).
absl::StatusOr<RopeKvCacheParams> ResolveRopeKvCache(
    const Stream& stream, const RopeKvCacheParams& p);

#if PDW_HAVE_CUDA
// The CUDA launcher's params for resolved `p` (bf16 buffers).
RopeKvCacheCudaParams ToRopeKvCacheCudaParams(const RopeKvCacheParams& p);
#endif

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_ROPE_KV_CACHE_H_
