#include "worker/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/sampling_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "sampling";
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// NaN logits never win and never get probability mass.
inline float Logit(const float* row, int32_t id) {
  const float v = row[id];
  return std::isnan(v) ? kNegInf : v;
}

struct Draw {
  int32_t token = 0;
  float logprob = kNegInf;
};

// log_softmax(row)[token] over the whole vocabulary.
float RawLogprob(const float* row, int vocab, int32_t token) {
  float max = kNegInf;
  for (int v = 0; v < vocab; ++v) max = std::max(max, Logit(row, v));
  if (max == kNegInf) return kNegInf;
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(double{Logit(row, v)} - max);
  return static_cast<float>(double{Logit(row, token)} - max - std::log(sum));
}

// Inverse CDF over `count` candidates (ids via `id_at`, weights via
// `weight_at`), summing to `total`: the first candidate whose cumulative
// weight exceeds u·total; rounding falls back to the last positive weight.
template <typename IdAt, typename WeightAt>
int32_t InverseCdf(int count, double total, double u, IdAt id_at,
                   WeightAt weight_at) {
  const double target = u * total;
  double cumulative = 0.0;
  int32_t last_positive = id_at(0);
  for (int m = 0; m < count; ++m) {
    const double w = weight_at(m);
    if (w <= 0.0) continue;
    last_positive = id_at(m);
    cumulative += w;
    if (cumulative > target) return last_positive;
  }
  return last_positive;
}

// One row. `order` ([vocab] int32) and `weights` ([vocab] double) are scratch.
Draw SampleRow(const float* row, int vocab, float temperature, int32_t top_k,
               float top_p, double u, int32_t* order, double* weights) {
  const bool greedy = !(temperature >= kGreedyTemperature);
  const double inv_temperature = greedy ? 1.0 : 1.0 / temperature;
  const bool use_top_k = top_k > 0 && top_k < vocab;
  const bool use_top_p = !std::isnan(top_p) && top_p < 1.0f;
  Draw draw;

  int32_t argmax = 0;
  float max = kNegInf;
  for (int v = 0; v < vocab; ++v) {
    const float l = Logit(row, v);
    if (l > max) {  // strict: ties keep the lowest id
      max = l;
      argmax = v;
    }
  }
  if (max == kNegInf) return draw;  // nothing has probability mass
  auto weight_of = [row, max, inv_temperature](int32_t id) {
    return std::exp((double{Logit(row, id)} - max) * inv_temperature);
  };

  if (!use_top_k && !use_top_p) {
    // Whole vocabulary in id order: no sort needed.
    double total = 0.0;
    for (int v = 0; v < vocab; ++v) total += weights[v] = weight_of(v);
    draw.token = greedy ? argmax
                        : InverseCdf(
                              vocab, total, u, [](int m) { return m; },
                              [weights](int m) { return weights[m]; });
    draw.logprob = static_cast<float>(std::log(weights[draw.token] / total));
    return draw;
  }

  // Candidates most likely first, ties to the lower id: a strict total
  // order, so the kept set and the CDF order are deterministic. Only a
  // prefix of `order` is sorted: the top_k, or (top-p alone) a prefix grown
  // until it holds top_p of the mass, which for peaked LLM distributions is
  // a few hundred tokens instead of a full sort of the vocabulary.
  std::iota(order, order + vocab, 0);
  auto more_likely = [row](int32_t a, int32_t b) {
    const float la = Logit(row, a);
    const float lb = Logit(row, b);
    return la > lb || (la == lb && a < b);
  };
  int sorted = 0;
  double candidate_total = 0.0;  // mass of all candidates (top-p's base)
  if (use_top_k) {
    std::partial_sort(order, order + top_k, order + vocab, more_likely);
    sorted = top_k;
    for (int m = 0; m < sorted; ++m) {
      candidate_total += weights[m] = weight_of(order[m]);
    }
  } else {
    for (int v = 0; v < vocab; ++v) candidate_total += weight_of(v);
    constexpr int kFirstPrefix = 256;
    sorted = std::min(vocab, kFirstPrefix);
    for (;;) {
      std::partial_sort(order, order + sorted, order + vocab, more_likely);
      double prefix_mass = 0.0;
      for (int m = 0; m < sorted; ++m) {
        prefix_mass += weights[m] = weight_of(order[m]);
      }
      if (sorted == vocab || prefix_mass >= double{top_p} * candidate_total) {
        break;
      }
      sorted = static_cast<int>(std::min<int64_t>(vocab, int64_t{sorted} * 8));
    }
  }

  int kept = sorted;
  double kept_total = candidate_total;
  if (use_top_p) {
    // Keep candidate m while the mass before it is below top_p of the
    // candidates' mass (the shortest prefix reaching top_p); always keep the
    // first. The sorted prefix is long enough by construction.
    const double threshold = double{top_p} * candidate_total;
    kept_total = weights[0];
    kept = 1;
    while (kept < sorted && kept_total < threshold) {
      kept_total += weights[kept];
      ++kept;
    }
  }
  const int chosen =  // index into order[]
      greedy ? 0
             : InverseCdf(
                   kept, kept_total, u, [](int m) { return m; },
                   [weights](int m) { return weights[m]; });
  draw.token = order[chosen];
  draw.logprob = static_cast<float>(std::log(weights[chosen] / kept_total));
  return draw;
}

void SamplingCpu(const SamplingParams& p) {
  auto* order = static_cast<int32_t*>(p.workspace.data());
  auto* weights = reinterpret_cast<double*>(
      static_cast<char*>(p.workspace.data()) +
      sizeof(double) * ((sizeof(int32_t) * p.vocab_size + sizeof(double) - 1) /
                        sizeof(double)));
  for (int r = 0; r < p.num_reqs; ++r) {
    const float* row =
        p.logits.as<const float>() + static_cast<int64_t>(r) * p.vocab_size;
    const double u = SamplingUniform(p.seeds.as<const uint64_t>()[r],
                                     p.positions.as<const int32_t>()[r]);
    Draw draw = SampleRow(row, p.vocab_size, p.temperature.as<const float>()[r],
                          p.top_k.as<const int32_t>()[r],
                          p.top_p.as<const float>()[r], u, order, weights);
    if (p.logprob_mode == LogprobMode::kRaw) {
      draw.logprob = RawLogprob(row, p.vocab_size, draw.token);
    }
    p.sampled_token_ids.as<int32_t>()[r] = draw.token;
    p.sampled_logprobs.as<float>()[r] = draw.logprob;
  }
}

// SamplingPath::kGreedy on the CPU: the argmax and RawLogprob (the value
// kGeneral gives a greedy untruncated row), without reading the per-row
// options.
void GreedySamplingCpu(const SamplingParams& p) {
  for (int r = 0; r < p.num_reqs; ++r) {
    const float* row =
        p.logits.as<const float>() + static_cast<int64_t>(r) * p.vocab_size;
    int32_t token = 0;
    float best = kNegInf;
    for (int v = 0; v < p.vocab_size; ++v) {
      if (Logit(row, v) > best) {  // ascending: ties keep the lowest id
        best = Logit(row, v);
        token = v;
      }
    }
    p.sampled_token_ids.as<int32_t>()[r] = token;
    p.sampled_logprobs.as<float>()[r] =
        best == kNegInf ? kNegInf : RawLogprob(row, p.vocab_size, token);
  }
}

#if PDW_HAVE_CUDA
absl::Status SamplingOnCuda(Stream& stream, const SamplingParams& p) {
  SamplingCudaParams c;
  c.logits = p.logits.as<const float>();
  c.temperature = p.temperature.as<const float>();
  c.top_k = p.top_k.as<const int32_t>();
  c.top_p = p.top_p.as<const float>();
  c.seeds = p.seeds.as<const uint64_t>();
  c.positions = p.positions.as<const int32_t>();
  c.workspace = p.workspace.data();
  c.sampled_token_ids = p.sampled_token_ids.as<int32_t>();
  c.sampled_logprobs = p.sampled_logprobs.as<float>();
  c.num_reqs = p.num_reqs;
  c.vocab_size = p.vocab_size;
  c.raw_logprobs = p.logprob_mode == LogprobMode::kRaw;
  c.greedy_temperature = kGreedyTemperature;
  c.num_truncated_rows = p.num_truncated_rows;
  c.greedy_tiles = p.greedy_tiles.empty() ? nullptr : p.greedy_tiles.data();
  const bool greedy = p.path == SamplingPath::kGreedy;
  return LaunchCudaOp(stream, kOp, [c, greedy](const OpContext& ctx) {
    const auto cuda_stream = static_cast<cudaStream_t>(ctx.cuda_stream);
    return CudaStatus(greedy ? LaunchGreedySamplingCuda(c, cuda_stream)
                             : LaunchSamplingCuda(c, cuda_stream),
                      kOp);
  });
}
#endif

}  // namespace

absl::StatusOr<size_t> SamplingWorkspaceBytesFor(DeviceKind kind,
                                                 int vocab_size,
                                                 int max_num_reqs) {
  if (vocab_size <= 0 || max_num_reqs <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling: vocab_size and max_num_reqs must be positive, got ",
        vocab_size, " and ", max_num_reqs));
  }
  if (kind == DeviceKind::kCpu) return SamplingWorkspaceBytes(vocab_size);
#if PDW_HAVE_CUDA
  size_t bytes = 0;
  absl::Status status =
      CudaStatus(SamplingCudaWorkspaceBytes(vocab_size, max_num_reqs, &bytes),
                 "sampling workspace size (cub)");
  if (!status.ok()) return status;
  return bytes;
#else
  return absl::UnimplementedError(
      "sampling: this binary was built without the CUDA kernels");
#endif
}

size_t GreedyTilesBytes(int num_rows) {
#if PDW_HAVE_CUDA
  return num_rows > 0 ? GreedyTilesCudaBytes(num_rows) : 0;
#else
  (void)num_rows;
  return 0;
#endif
}

size_t SamplingWorkspaceBytes(int vocab_size) {
  const size_t vocab = vocab_size > 0 ? static_cast<size_t>(vocab_size) : 0;
  // int32 order, padded to 8 bytes, then double weights.
  const size_t order_bytes = (sizeof(int32_t) * vocab + sizeof(double) - 1) /
                             sizeof(double) * sizeof(double);
  return order_bytes + sizeof(double) * vocab;
}

double SamplingUniform(uint64_t seed, int32_t position) {
  // splitmix64: stream = Mix64(seed), element i = Mix64(stream + (i+1)·γ).
  const uint64_t stream = Mix64(seed + kGolden);
  const uint64_t counter =
      static_cast<uint64_t>(static_cast<uint32_t>(position));
  const uint64_t bits = Mix64(stream + (counter + 1) * kGolden);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

absl::Status LaunchSampling(Stream& stream, const SamplingParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(
      kOp, "num_reqs is a host value; sample after the step"));
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_reqs", p.num_reqs),
                  CheckPositive(kOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int n = p.num_reqs;
  if (!p.greedy_tiles.empty() &&
      (p.path != SamplingPath::kGreedy || stream.kind() != DeviceKind::kCuda)) {
    return absl::InvalidArgumentError(
        "sampling: 'greedy_tiles' are read by the greedy path on CUDA only");
  }
  if (p.path == SamplingPath::kGreedy) {
    status = FirstError(
        {CheckBuffer(kOp, "logits", p.logits,
                     static_cast<int64_t>(n) * p.vocab_size, sizeof(float),
                     absl::StrFormat("[num_reqs=%d, vocab_size=%d] fp32", n,
                                     p.vocab_size)),
         CheckBuffer(kOp, "sampled_token_ids", p.sampled_token_ids, n,
                     sizeof(int32_t),
                     absl::StrFormat("[num_reqs=%d] int32", n)),
         CheckBuffer(kOp, "sampled_logprobs", p.sampled_logprobs, n,
                     sizeof(float), absl::StrFormat("[num_reqs=%d] fp32", n)),
         CheckBackendImplemented(stream, kOp)});
    if (!status.ok()) return status;
#if PDW_HAVE_CUDA
    if (stream.kind() == DeviceKind::kCuda) {
      // The slices' partial results (SamplingWorkspaceBytesFor covers them).
      PDW_RETURN_IF_ERROR(CheckBuffer(
          kOp, "workspace", p.workspace,
          static_cast<int64_t>(GreedySamplingCudaWorkspaceBytes(n)), 1,
          absl::StrFormat("[num_reqs=%d, 64 slices] greedy partials", n)));
      if (reinterpret_cast<uintptr_t>(p.workspace.data()) % 4 != 0) {
        return absl::InvalidArgumentError(
            "sampling: the greedy path's 'workspace' must be 4-byte aligned");
      }
      if (!p.greedy_tiles.empty()) {
        PDW_RETURN_IF_ERROR(CheckBuffer(
            kOp, "greedy_tiles", p.greedy_tiles,
            static_cast<int64_t>(GreedyTilesCudaBytes(n)), 1,
            absl::StrFormat("[num_reqs=%d, 512 tiles] greedy tile folds", n)));
        if (reinterpret_cast<uintptr_t>(p.greedy_tiles.data()) % 4 != 0) {
          return absl::InvalidArgumentError(
              "sampling: 'greedy_tiles' must be 4-byte aligned");
        }
      }
      return SamplingOnCuda(stream, p);
    }
#endif
    return stream.Launch(kOp, [p](const OpContext&) { GreedySamplingCpu(p); });
  }
  status = FirstError(
      {CheckBuffer(kOp, "logits", p.logits,
                   static_cast<int64_t>(n) * p.vocab_size, sizeof(float),
                   absl::StrFormat("[num_reqs=%d, vocab_size=%d] fp32", n,
                                   p.vocab_size)),
       CheckBuffer(kOp, "temperature", p.temperature, n, sizeof(float),
                   absl::StrFormat("[num_reqs=%d] fp32", n)),
       CheckBuffer(kOp, "top_k", p.top_k, n, sizeof(int32_t),
                   absl::StrFormat("[num_reqs=%d] int32", n)),
       CheckBuffer(kOp, "top_p", p.top_p, n, sizeof(float),
                   absl::StrFormat("[num_reqs=%d] fp32", n)),
       CheckBuffer(kOp, "seeds", p.seeds, n, sizeof(uint64_t),
                   absl::StrFormat("[num_reqs=%d] uint64", n)),
       CheckBuffer(kOp, "positions", p.positions, n, sizeof(int32_t),
                   absl::StrFormat("[num_reqs=%d] int32", n)),
       CheckBuffer(kOp, "sampled_token_ids", p.sampled_token_ids, n,
                   sizeof(int32_t), absl::StrFormat("[num_reqs=%d] int32", n)),
       CheckBuffer(kOp, "sampled_logprobs", p.sampled_logprobs, n,
                   sizeof(float), absl::StrFormat("[num_reqs=%d] fp32", n)),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (p.num_truncated_rows < -1 || p.num_truncated_rows > n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling: num_truncated_rows must be in [-1, num_reqs=%d], got %d", n,
        p.num_truncated_rows));
  }
  absl::StatusOr<size_t> workspace_bytes =
      SamplingWorkspaceBytesFor(stream.kind(), p.vocab_size, p.num_reqs);
  if (!workspace_bytes.ok()) return workspace_bytes.status();
  status = CheckBuffer(
      kOp, "workspace", p.workspace, static_cast<int64_t>(*workspace_bytes), 1,
      "SamplingWorkspaceBytesFor(backend, vocab_size, num_reqs) bytes");
  if (!status.ok()) return status;
  if (reinterpret_cast<uintptr_t>(p.workspace.data()) % alignof(double) != 0 ||
      reinterpret_cast<uintptr_t>(p.seeds.data()) % alignof(uint64_t) != 0) {
    return absl::InvalidArgumentError(
        "sampling: buffers 'workspace' and 'seeds' must be 8-byte aligned");
  }
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    if (reinterpret_cast<uintptr_t>(p.workspace.data()) % 256 != 0) {
      return absl::InvalidArgumentError(
          "sampling: the CUDA workspace must be 256-byte aligned");
    }
    return SamplingOnCuda(stream, p);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { SamplingCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
