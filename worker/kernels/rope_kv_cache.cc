#include "worker/kernels/rope_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "rope_kv_cache";
constexpr double kPi = 3.14159265358979323846;

// Rotates the first `rotary_dim` of each of `num_heads` heads of `head_dim`
// floats at `x` (contiguous heads) by the per-pair cos/sin of one token.
void RotateHeads(float* x, int num_heads, int head_dim, int rotary_dim,
                 const float* cos_half, const float* sin_half) {
  const int half = rotary_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    float* lo = x + static_cast<int64_t>(h) * head_dim;
    float* hi = lo + half;
    for (int i = 0; i < half; ++i) {
      const float a = lo[i];
      const float b = hi[i];
      lo[i] = a * cos_half[i] - b * sin_half[i];
      hi[i] = b * cos_half[i] + a * sin_half[i];
    }
  }
}

// RMS-normalizes `num_heads` heads of `head_dim` floats at `x` (contiguous
// heads) in place, each scaled by `weight` [head_dim].
void NormalizeHeads(float* x, int num_heads, int head_dim, const float* weight,
                    float epsilon) {
  for (int h = 0; h < num_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * head_dim;
    double sum_squares = 0.0;
    for (int i = 0; i < head_dim; ++i) {
      sum_squares += static_cast<double>(head[i]) * head[i];
    }
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_squares / head_dim + epsilon));
    for (int i = 0; i < head_dim; ++i) head[i] = head[i] * inv_rms * weight[i];
  }
}

void RopeKvCacheCpu(const RopeKvCacheParams& p) {
  const int32_t* positions = p.positions.as<const int32_t>();
  const int32_t* slots = p.slot_mapping.as<const int32_t>();
  const float* inv_freq = p.inv_freq.as<const float>();
  const int rotary_dim = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
  const int half = rotary_dim / 2;
  const int64_t kv_row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const int64_t num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  float cos_half[kMaxHeadDim / 2];
  float sin_half[kMaxHeadDim / 2];
  for (int t = 0; t < p.num_tokens; ++t) {
    const float position = static_cast<float>(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];
      cos_half[i] = std::cos(angle) * p.rotary_scale;
      sin_half[i] = std::sin(angle) * p.rotary_scale;
    }
    float* q =
        p.query.as<float>() + static_cast<int64_t>(t) * p.query_row_stride;
    float* k = p.key.as<float>() + static_cast<int64_t>(t) * p.key_row_stride;
    const float* v = p.value.as<const float>() +
                     static_cast<int64_t>(t) * p.value_row_stride;
    if (!p.q_norm_weight.empty()) {
      NormalizeHeads(q, p.num_heads, p.head_dim,
                     p.q_norm_weight.as<const float>(), p.qk_norm_epsilon);
      NormalizeHeads(k, p.num_kv_heads, p.head_dim,
                     p.k_norm_weight.as<const float>(), p.qk_norm_epsilon);
    }
    RotateHeads(q, p.num_heads, p.head_dim, rotary_dim, cos_half, sin_half);
    RotateHeads(k, p.num_kv_heads, p.head_dim, rotary_dim, cos_half, sin_half);

    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding token
    std::memcpy(p.key_cache.as<float>() + slot * kv_row, k,
                sizeof(float) * kv_row);
    std::memcpy(p.value_cache.as<float>() + slot * kv_row, v,
                sizeof(float) * kv_row);
  }
}

#if PDW_HAVE_CUDA
absl::Status RopeKvCacheOnCuda(Stream& stream, const RopeKvCacheParams& p) {
  const RopeKvCacheCudaParams c = ToRopeKvCacheCudaParams(p);
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchRopeKvCacheCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kOp);
  });
}
#endif

}  // namespace

#if PDW_HAVE_CUDA
RopeKvCacheCudaParams ToRopeKvCacheCudaParams(const RopeKvCacheParams& p) {
  RopeKvCacheCudaParams c;
  c.positions = p.positions.as<const int32_t>();
  c.slot_mapping = p.slot_mapping.as<const int32_t>();
  c.inv_freq = p.inv_freq.as<const float>();
  c.query = p.query.as<__nv_bfloat16>();
  c.key = p.key.as<__nv_bfloat16>();
  c.value = p.value.as<const __nv_bfloat16>();
  c.key_cache = p.key_cache.as<__nv_bfloat16>();
  c.value_cache = p.value_cache.as<__nv_bfloat16>();
  c.num_tokens = p.num_tokens;
  c.num_heads = p.num_heads;
  c.num_kv_heads = p.num_kv_heads;
  c.head_dim = p.head_dim;
  c.num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  c.query_row_stride = p.query_row_stride;
  c.key_row_stride = p.key_row_stride;
  c.value_row_stride = p.value_row_stride;
  if (!p.q_norm_weight.empty()) {
    c.q_norm_weight = p.q_norm_weight.as<const __nv_bfloat16>();
    c.k_norm_weight = p.k_norm_weight.as<const __nv_bfloat16>();
    c.qk_norm_epsilon = p.qk_norm_epsilon;
  }
  c.rotary_dim = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
  c.rotary_scale = p.rotary_scale;
  return c;
}
#endif

absl::Status ValidateRopeConfig(const RopeConfig& config) {
  if (config.head_dim <= 0 || config.head_dim % 2 != 0 ||
      config.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope: head_dim must be even and in [2, %d], got %d",
                        kMaxHeadDim, config.head_dim));
  }
  if (!(config.theta > 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rope: rope_theta must be positive, got %g", config.theta));
  }
  if (config.scaling == RopeScalingType::kLinear && !(config.factor > 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rope: rope_scaling.factor must be positive, got %g", config.factor));
  }
  if (config.scaling == RopeScalingType::kYarn) {
    if (!(config.factor >= 1.0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: yarn rope_scaling.factor must be at least 1, got %g",
          config.factor));
    }
    if (!(config.beta_fast > config.beta_slow) || !(config.beta_slow > 0.0) ||
        config.original_max_position_embeddings <= 0 || !(config.theta > 1)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: yarn needs beta_fast > beta_slow > 0, a positive "
          "original_max_position_embeddings and theta > 1, got %g, %g, %d, "
          "%g",
          config.beta_fast, config.beta_slow,
          config.original_max_position_embeddings, config.theta));
    }
  }
  if (config.scaling == RopeScalingType::kLongrope) {
    if (config.pair_factors.size() !=
        static_cast<size_t>(config.head_dim / 2)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: longrope needs one factor per pair (%d), got %d",
          config.head_dim / 2, config.pair_factors.size()));
    }
    for (const double f : config.pair_factors) {
      if (!(f > 0.0) || std::isinf(f)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rope: longrope factors must be positive and finite, got %g", f));
      }
    }
  }
  if (config.scaling == RopeScalingType::kLlama3) {
    if (!(config.factor > 0.0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: rope_scaling.factor must be positive, got %g", config.factor));
    }
    if (!(config.low_freq_factor > 0.0) ||
        !(config.high_freq_factor > config.low_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: rope_scaling needs 0 < low_freq_factor < high_freq_factor, "
          "got %g and %g",
          config.low_freq_factor, config.high_freq_factor));
    }
    if (config.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope: rope_scaling.original_max_position_embeddings must be "
          "positive, got %d",
          config.original_max_position_embeddings));
    }
  }
  return absl::OkStatus();
}

std::vector<float> ComputeRopeInvFreq(const RopeConfig& config) {
  const absl::Status valid = ValidateRopeConfig(config);
  CHECK(valid.ok()) << valid;
  const int half = config.head_dim / 2;
  std::vector<float> inv_freq(half);
  // Wavelength bounds (in positions) of the llama3 bands.
  const double context = config.original_max_position_embeddings;
  const double keep_below = context / config.high_freq_factor;
  const double scale_above = context / config.low_freq_factor;
  // YaRN's ramp over the pairs: its ends, in pair indices.
  double ramp_low = 0, ramp_high = 0;
  if (config.scaling == RopeScalingType::kYarn) {
    auto correction_dim = [&config](double rotations) {
      return config.head_dim *
             std::log(config.original_max_position_embeddings /
                      (rotations * 2.0 * kPi)) /
             (2.0 * std::log(config.theta));
    };
    ramp_low = correction_dim(config.beta_fast);
    ramp_high = correction_dim(config.beta_slow);
    if (config.truncate) {
      ramp_low = std::floor(ramp_low);
      ramp_high = std::ceil(ramp_high);
    }
    ramp_low = std::max(ramp_low, 0.0);
    ramp_high = std::min(ramp_high, config.head_dim - 1.0);
    if (ramp_low == ramp_high) ramp_high += 0.001;
  }
  for (int i = 0; i < half; ++i) {
    const double exponent = 2.0 * i / config.head_dim;
    double freq = 1.0 / std::pow(config.theta, exponent);
    if (config.scaling == RopeScalingType::kLinear) freq /= config.factor;
    if (config.scaling == RopeScalingType::kLongrope) {
      freq /= config.pair_factors[i];
    }
    if (config.scaling == RopeScalingType::kYarn) {
      // 0 below the ramp (the fast pairs keep their frequency), 1 above it.
      const double ramp =
          std::clamp((i - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
      freq = freq / config.factor * ramp + freq * (1.0 - ramp);
    }
    if (config.scaling == RopeScalingType::kLlama3) {
      const double wavelength = 2.0 * kPi / freq;
      if (wavelength > scale_above) {
        freq /= config.factor;  // low frequency: fully interpolated
      } else if (wavelength >= keep_below) {
        // Medium band: blend the scaled and unscaled frequency, weighted by
        // where context / wavelength lies in [low_freq_factor,
        // high_freq_factor] (0 at the low end, 1 at the high end).
        const double blend = (context / wavelength - config.low_freq_factor) /
                             (config.high_freq_factor - config.low_freq_factor);
        freq = (1.0 - blend) * freq / config.factor + blend * freq;
      }
      // High frequency (wavelength < keep_below): unchanged.
    }
    inv_freq[i] = static_cast<float>(freq);
  }
  return inv_freq;
}

absl::StatusOr<RopeKvCacheParams> ResolveRopeKvCache(
    const Stream& stream, const RopeKvCacheParams& p) {
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_tokens", p.num_tokens),
                  CheckPositive(kOp, "num_heads", p.num_heads),
                  CheckPositive(kOp, "num_kv_heads", p.num_kv_heads),
                  CheckPositive(kOp, "head_dim", p.head_dim),
                  CheckPositive(kOp, "block_size", p.block_size),
                  CheckPositive(kOp, "num_blocks", p.num_blocks)});
  if (!status.ok()) return status;
  if (p.head_dim % 2 != 0 || p.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: head_dim must be even and <= %d, got %d", kOp,
                        kMaxHeadDim, p.head_dim));
  }
  if (p.q_norm_weight.empty() != p.k_norm_weight.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: q_norm_weight and k_norm_weight come together (got only %s)", kOp,
        p.q_norm_weight.empty() ? "k_norm_weight" : "q_norm_weight"));
  }
  const bool qk_norm = !p.q_norm_weight.empty();
  const int rotary_dim = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
  if (rotary_dim % 2 != 0 || rotary_dim > p.head_dim || p.rotary_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: rotary_dim must be even and in [0, head_dim=%d], "
                        "got %d",
                        kOp, p.head_dim, p.rotary_dim));
  }
  if (!(p.rotary_scale > 0) || std::isinf(p.rotary_scale)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: rotary_scale must be positive and finite, got %g",
                        kOp, p.rotary_scale));
  }
  if (qk_norm && !(p.qk_norm_epsilon > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: qk_norm_epsilon must be positive, got %g", kOp,
                        p.qk_norm_epsilon));
  }
  RopeKvCacheParams resolved = p;
  const int q_width = p.num_heads * p.head_dim;
  const int kv_width = p.num_kv_heads * p.head_dim;
  if (resolved.query_row_stride == 0) resolved.query_row_stride = q_width;
  if (resolved.key_row_stride == 0) resolved.key_row_stride = kv_width;
  if (resolved.value_row_stride == 0) resolved.value_row_stride = kv_width;
  if (resolved.query_row_stride < q_width ||
      resolved.key_row_stride < kv_width ||
      resolved.value_row_stride < kv_width) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: row strides (query %d, key %d, value %d) must be 0 or at least "
        "the row width (%d, %d, %d)",
        kOp, p.query_row_stride, p.key_row_stride, p.value_row_stride, q_width,
        kv_width, kv_width));
  }
  const int64_t cache_elements =
      static_cast<int64_t>(p.num_blocks) * p.block_size * kv_width;
  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  const std::string cache_layout = absl::StrFormat(
      "[num_blocks=%d, block_size=%d, num_kv_heads=%d, head_dim=%d] %s",
      p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim, type);
  status = FirstError(
      {CheckModelDType(stream, kOp, "dtype", p.dtype),
       CheckBuffer(kOp, "positions", p.positions, p.num_tokens, sizeof(int32_t),
                   absl::StrFormat("[num_tokens=%d] int32", p.num_tokens)),
       CheckBuffer(kOp, "slot_mapping", p.slot_mapping, p.num_tokens,
                   sizeof(int32_t),
                   absl::StrFormat("[num_tokens=%d] int32", p.num_tokens)),
       CheckBuffer(kOp, "inv_freq", p.inv_freq, rotary_dim / 2, sizeof(float),
                   absl::StrFormat("[rotary_dim / 2=%d] fp32", rotary_dim / 2)),
       CheckBuffer(
           kOp, "query", p.query,
           StridedElements(p.num_tokens, q_width, resolved.query_row_stride),
           element,
           absl::StrFormat("[num_tokens=%d, num_heads=%d, "
                           "head_dim=%d] %s, row stride %d",
                           p.num_tokens, p.num_heads, p.head_dim, type,
                           resolved.query_row_stride)),
       CheckBuffer(
           kOp, "key", p.key,
           StridedElements(p.num_tokens, kv_width, resolved.key_row_stride),
           element,
           absl::StrFormat("[num_tokens=%d, num_kv_heads=%d, "
                           "head_dim=%d] %s, row stride %d",
                           p.num_tokens, p.num_kv_heads, p.head_dim, type,
                           resolved.key_row_stride)),
       CheckBuffer(
           kOp, "value", p.value,
           StridedElements(p.num_tokens, kv_width, resolved.value_row_stride),
           element,
           absl::StrFormat("[num_tokens=%d, num_kv_heads=%d, "
                           "head_dim=%d] %s, row stride %d",
                           p.num_tokens, p.num_kv_heads, p.head_dim, type,
                           resolved.value_row_stride)),
       CheckBuffer(kOp, "key_cache", p.key_cache, cache_elements, element,
                   cache_layout),
       CheckBuffer(kOp, "value_cache", p.value_cache, cache_elements, element,
                   cache_layout),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (qk_norm) {
    const std::string norm_layout =
        absl::StrFormat("[head_dim=%d] %s", p.head_dim, type);
    PDW_RETURN_IF_ERROR(
        FirstError({CheckBuffer(kOp, "q_norm_weight", p.q_norm_weight,
                                p.head_dim, element, norm_layout),
                    CheckBuffer(kOp, "k_norm_weight", p.k_norm_weight,
                                p.head_dim, element, norm_layout)}));
  }
  return resolved;
}

absl::Status LaunchRopeKvCache(Stream& stream, const RopeKvCacheParams& p) {
  PDW_ASSIGN_OR_RETURN(const RopeKvCacheParams resolved,
                       ResolveRopeKvCache(stream, p));
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    return RopeKvCacheOnCuda(stream, resolved);
  }
#endif
  return stream.Launch(
      kOp, [resolved](const OpContext&) { RopeKvCacheCpu(resolved); });
}

}  // namespace kernels
}  // namespace pdworker
