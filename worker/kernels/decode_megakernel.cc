#include "worker/kernels/decode_megakernel.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "worker/kernels/decode_megakernel_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "decode_megakernel";

#if PDW_HAVE_CUDA
// One projection of the megakernel: `what` the separate launch checks, the
// CUDA-core skinny GEMM at one token with `epilogue` and `prologue`.
absl::Status CheckProjection(const Stream& stream, int layer, const char* name,
                             const LinearParams& p, LinearCudaEpilogue epilogue,
                             LinearCudaPrologue prologue, LinearCudaParams* c) {
  PDW_ASSIGN_OR_RETURN(*c, ResolveLinearCuda(stream, p));
  if (c->num_tokens != 1 || c->epilogue != epilogue ||
      c->prologue != prologue ||
      c->output_type != LinearCudaOutput::kBFloat16 ||
      ChosenLinearCudaKernel(*c) != LinearCudaKernel::kSkinnyGemm) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: layer %d's %s must be the fused one-token projection on the "
        "CUDA-core skinny GEMM (num_tokens 1, bf16 output, the fused step's "
        "prologue and epilogue, kernel auto or skinny_gemm); got num_tokens "
        "%d",
        kOp, layer, name, c->num_tokens));
  }
  return absl::OkStatus();
}
#endif

}  // namespace

size_t DecodeMegakernelBytes(DeviceKind kind, int num_layers) {
#if PDW_HAVE_CUDA
  if (kind != DeviceKind::kCuda || num_layers <= 0) return 0;
  // The barrier words and split counters, then the layer table.
  return kMegakernelStateBytes +
         sizeof(DecodeMegakernelLayerCuda) * static_cast<size_t>(num_layers);
#else
  (void)kind;
  (void)num_layers;
  return 0;
#endif
}

std::vector<std::vector<PrefetchRange>> MegakernelPrefetchSchedule(
    const std::vector<int64_t>& segment_bytes, int num_layers, int64_t window) {
  constexpr int kPhases = 6;
  constexpr int kMaxRanges = 4;
  std::vector<std::vector<PrefetchRange>> schedule(
      static_cast<size_t>(std::max(num_layers, 0)) * kPhases);
  const int num_segments = static_cast<int>(segment_bytes.size());
  if (window <= 0 || num_segments < 4 * num_layers) return schedule;
  window = window / 16 * 16;
  std::vector<int64_t> offset(num_segments + 1, 0);
  for (int s = 0; s < num_segments; ++s) {
    offset[s + 1] = offset[s] + segment_bytes[s];
  }
  const int64_t total = offset[num_segments];
  int64_t cursor = 0;  // everything before it has been asked for
  int segment = 0;     // the segment holding `cursor`
  for (int l = 0; l < num_layers; ++l) {
    for (int phase = 0; phase < kPhases; ++phase) {
      // The phase's own weights: qkv, none (attention: the point is o_proj's
      // start), o_proj, gate_up, down.
      static constexpr int kOwn[kPhases] = {0, -1, -1, 1, 2, 3};
      const int own = kOwn[phase];
      const int at = 4 * l + (own < 0 ? 1 : own);
      const int64_t own_end =
          own < 0 ? offset[at] : offset[at] + segment_bytes[at];
      const int64_t target = std::min(total, own_end + window);
      std::vector<PrefetchRange>& ranges = schedule[l * kPhases + phase];
      while (cursor < target && static_cast<int>(ranges.size()) < kMaxRanges) {
        while (segment < num_segments && offset[segment + 1] <= cursor) {
          ++segment;
        }
        if (segment >= num_segments) break;
        const int64_t end = std::min(target, offset[segment + 1]);
        const int64_t bytes = (end - cursor) / 16 * 16;
        if (bytes <= 0) {
          // A segment whose size is not a multiple of 16: skip its tail.
          cursor = offset[segment + 1];
          continue;
        }
        ranges.push_back({segment, cursor - offset[segment], bytes});
        cursor += bytes;
      }
    }
  }
  return schedule;
}

absl::StatusOr<DecodeMegakernelPlan> DecodeMegakernelPlan::Create(
    Stream& stream, const DecodeMegakernelParams& params) {
  if (stream.kind() != DeviceKind::kCuda) {
    return absl::UnimplementedError(
        absl::StrFormat("%s: runs on the CUDA backend only, not on %s", kOp,
                        DeviceKindName(stream.kind())));
  }
#if PDW_HAVE_CUDA
  const DeviceBuffer memory = params.memory;
  const std::vector<DecodeMegakernelLayer>& layers = params.layers;
  const DecodeMegakernelTuning& tuning = params.tuning;
  const int num_layers = static_cast<int>(layers.size());
  if (num_layers == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: layers is empty", kOp));
  }
  if (tuning.ctas_per_sm < 0 || tuning.max_ctas < 0 ||
      tuning.prefetch_window_bytes < -1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: ctas_per_sm and max_ctas must be >= 0 (0: as many as fit) and "
        "prefetch_window_bytes >= -1 (-1: half of L2), got %d, %d and %d",
        kOp, tuning.ctas_per_sm, tuning.max_ctas,
        tuning.prefetch_window_bytes));
  }
  const size_t bytes = DecodeMegakernelBytes(DeviceKind::kCuda, num_layers);
  if (memory.size_bytes() < bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: memory has %d bytes, %d layers need %d", kOp,
                        memory.size_bytes(), num_layers, bytes));
  }
  using E = LinearCudaEpilogue;
  using P = LinearCudaPrologue;
  std::vector<DecodeMegakernelLayerCuda> table(num_layers);
  std::vector<int64_t> segment_bytes;
  std::vector<const void*> segment_base;
  int head_dim = 0, max_norm_features = 0;
  for (int l = 0; l < num_layers; ++l) {
    const DecodeMegakernelLayer& in = layers[l];
    DecodeMegakernelLayerCuda& out = table[l];
    PDW_RETURN_IF_ERROR(CheckProjection(
        stream, l, "qkv", in.qkv, E::kRopeKvCache, P::kRmsNorm, &out.qkv));
    PDW_RETURN_IF_ERROR(CheckProjection(stream, l, "o_proj", in.o_proj,
                                        E::kAddResidual, P::kNone,
                                        &out.o_proj));
    PDW_RETURN_IF_ERROR(CheckProjection(stream, l, "gate_up", in.gate_up,
                                        E::kSiluAndMul, P::kRmsNorm,
                                        &out.gate_up));
    PDW_RETURN_IF_ERROR(CheckProjection(stream, l, "down", in.down,
                                        E::kAddResidual, P::kNone, &out.down));
    PDW_ASSIGN_OR_RETURN(out.attention,
                         ResolveUniformDecodeCuda(stream, in.attention));
    const PagedAttentionCudaParams& a = out.attention;
    if (!a.decode_tensor_cores || a.uniform_query_len != 1 ||
        a.num_tokens != 1 || (head_dim != 0 && a.head_dim != head_dim)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: layer %d's attention must be one query token of one request "
          "(num_tokens %d, uniform_query_len %d) on the tensor-core split "
          "kernel (decode_kernel auto or tensor_cores, head_dim 64 or 128: "
          "got %d), with every layer's head_dim alike",
          kOp, l, a.num_tokens, a.uniform_query_len, a.head_dim));
    }
    if (a.num_tokens / a.uniform_query_len * a.num_kv_heads >
        kMegakernelMaxSplitCounters) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: layer %d has %d kv heads, more than the %d split counters", kOp,
          l, a.num_kv_heads, kMegakernelMaxSplitCounters));
    }
    head_dim = a.head_dim;
    for (const LinearCudaParams* c :
         {&out.qkv, &out.o_proj, &out.gate_up, &out.down}) {
      segment_base.push_back(c->weight);
      segment_bytes.push_back(static_cast<int64_t>(c->out_features) *
                              c->in_features * sizeof(__nv_bfloat16));
    }
    out.qkv_k_split =
        SkinnyGemmKSplit(out.qkv.in_features, out.qkv.out_features);
    out.o_proj_k_split =
        SkinnyGemmKSplit(out.o_proj.in_features, out.o_proj.out_features);
    out.gate_up_k_split =
        SkinnyGemmKSplit(out.gate_up.in_features, out.gate_up.out_features);
    out.down_k_split =
        SkinnyGemmKSplit(out.down.in_features, out.down.out_features);
    max_norm_features = std::max(
        {max_norm_features, out.qkv.in_features, out.gate_up.in_features});
  }

  if (!params.next_weights.empty() &&
      reinterpret_cast<uintptr_t>(params.next_weights.data()) % 16 == 0) {
    segment_base.push_back(params.next_weights.data());
    segment_bytes.push_back(
        static_cast<int64_t>(params.next_weights.size_bytes()));
  }
  int64_t window = tuning.prefetch_window_bytes;
  if (window < 0) {
    int device = 0, l2_bytes = 0;
    PDW_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), kOp));
    PDW_RETURN_IF_ERROR(CudaStatus(
        cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device),
        kOp));
    window = l2_bytes / 2;
  }
  const std::vector<std::vector<PrefetchRange>> schedule =
      MegakernelPrefetchSchedule(segment_bytes, num_layers, window);
  for (int l = 0; l < num_layers; ++l) {
    for (int phase = 0; phase < kMegakernelPhases; ++phase) {
      const std::vector<PrefetchRange>& ranges =
          schedule[l * kMegakernelPhases + phase];
      for (size_t r = 0; r < ranges.size(); ++r) {
        table[l].prefetch[phase][r].base =
            static_cast<const char*>(segment_base[ranges[r].segment]) +
            ranges[r].offset;
        table[l].prefetch[phase][r].bytes = ranges[r].bytes;
      }
    }
  }

  DecodeMegakernelPlan plan;
  plan.memory_ = memory;
  plan.reduce_ = tuning.reduce;
  plan.num_layers_ = num_layers;
  plan.head_dim_ = head_dim;
  plan.shared_bytes_ = DecodeMegakernelSharedBytes(head_dim, max_norm_features);
  PDW_RETURN_IF_ERROR(
      CudaStatus(DecodeMegakernelMaxCtas(head_dim, plan.shared_bytes_,
                                         tuning.ctas_per_sm, &plan.ctas_),
                 kOp));
  if (tuning.max_ctas > 0) plan.ctas_ = std::min(plan.ctas_, tuning.max_ctas);
  if (plan.ctas_ <= 0) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: not one CTA of %d bytes of shared memory fits on an SM", kOp,
        plan.shared_bytes_));
  }
  // The barrier words and split counters: zero.
  std::vector<unsigned char> host(bytes, 0);
  std::memcpy(host.data() + kMegakernelStateBytes, table.data(),
              sizeof(DecodeMegakernelLayerCuda) * table.size());
  PDW_RETURN_IF_ERROR(stream.CopyToDevice(memory, host.data(), bytes));
  return plan;
#else
  (void)params;
  return absl::UnimplementedError(
      absl::StrFormat("%s: built without CUDA", kOp));
#endif
}

absl::Status DecodeMegakernelPlan::Launch(Stream& stream) const {
  if (stream.kind() != DeviceKind::kCuda || num_layers_ == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: no plan for this stream", kOp));
  }
#if PDW_HAVE_CUDA
  DecodeMegakernelCudaParams p;
  unsigned char* state = static_cast<unsigned char*>(memory_.data());
  p.barrier = reinterpret_cast<MegakernelBarrierState*>(state);
  p.split_counters =
      reinterpret_cast<unsigned int*>(state + kMegakernelCountersOffset);
  p.layers = reinterpret_cast<const DecodeMegakernelLayerCuda*>(
      state + kMegakernelStateBytes);
  p.reduce = reduce_ == MegakernelReduce::kLastSplit
                 ? MegakernelReduceCuda::kLastSplit
                 : MegakernelReduceCuda::kOwnPhase;
  p.num_layers = num_layers_;
  p.head_dim = head_dim_;
  const int ctas = ctas_;
  const size_t shared_bytes = shared_bytes_;
  return LaunchCudaOp(
      stream, kOp, [p, ctas, shared_bytes](const OpContext& ctx) {
        return CudaStatus(LaunchDecodeMegakernelCuda(
                              p, ctas, shared_bytes,
                              static_cast<cudaStream_t>(ctx.cuda_stream)),
                          kOp);
      });
#else
  return absl::UnimplementedError(
      absl::StrFormat("%s: built without CUDA", kOp));
#endif
}

}  // namespace kernels
}  // namespace pdworker
