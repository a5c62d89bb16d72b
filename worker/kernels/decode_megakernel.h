// The decode megakernel (decode_megakernel.cu): every decoder layer of a
// one-token decode step in one cooperative kernel, bit-identical to the
// fused step's separate kernels (the same CTA bodies on the same virtual
// grids), with L2 prefetch of the weights ahead. CUDA only.
#ifndef PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_H_
#define PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/paged_attention.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {
namespace kernels {

// One layer as the fused one-token step launches it (LlamaForward's fused
// Linears at num_tokens 1 and its uniform decode attention).
struct DecodeMegakernelLayer {
  LinearParams qkv, o_proj, gate_up, down;
  PagedAttentionParams attention;
};

// Where the attention's reduce runs in the megakernel. kLastSplit: the last
// split CTA of each (request, kv head) to finish reduces its heads (five
// phases a layer); kOwnPhase: a phase of its own behind one more grid
// barrier (six). The same bits either way.
enum class MegakernelReduce { kLastSplit, kOwnPhase };

struct DecodeMegakernelTuning {
  // Resident CTAs per SM; 0: as many as fit (2 at head_dim 64, 1 at 128).
  int ctas_per_sm = 0;
  // At most this many CTAs in all; 0: no cap (tests use a few CTAs to run
  // several virtual CTAs of each phase on one).
  int max_ctas = 0;
  // Weight bytes ahead of the phase being computed that the phases ask L2
  // to prefetch; -1: half of the device's L2 (the rest keeps the phase's
  // own lines and the activations); 0: no prefetch.
  int64_t prefetch_window_bytes = -1;
  MegakernelReduce reduce = MegakernelReduce::kLastSplit;
};

// Device memory a plan of `num_layers` layers needs on a device of `kind`
// (its barrier words, split counters and layer table); 0 where there is no
// megakernel.
size_t DecodeMegakernelBytes(DeviceKind kind, int num_layers);

// The prefetch schedule: for phase `phase` (0..5: qkv, attention split,
// reduce, o_proj, gate_up, down) of layer `layer`, the byte ranges of
// `segments` (the weights in the order the step reads them: qkv, o_proj,
// gate_up, down of layer 0, then layer 1, ..., then optionally the weights
// the next kernel reads, the LM head) it asks L2 for, so that the
// prefetched bytes run `window` ahead of the end of the phase's own weights;
// each range is inside one segment, a multiple of 16 bytes, at most 4 per
// phase. Plain arithmetic on sizes (the CPU tests check it).
struct PrefetchRange {
  int segment = 0;
  int64_t offset = 0;  // within the segment
  int64_t bytes = 0;
};
std::vector<std::vector<PrefetchRange>> MegakernelPrefetchSchedule(
    const std::vector<int64_t>& segment_bytes, int num_layers, int64_t window);

struct DecodeMegakernelParams {
  DeviceBuffer memory;  // DecodeMegakernelBytes(kCuda, layers.size())
  std::vector<DecodeMegakernelLayer> layers;
  // Optional: the weights the kernel after the megakernel streams first
  // (the LM head); the last layer's phases prefetch its start into L2 as
  // they do the next layer's weights.
  DeviceBuffer next_weights;
  DecodeMegakernelTuning tuning;
};

class DecodeMegakernelPlan {
 public:
  // Checks every layer as its separate launches are checked, and that it is
  // what the megakernel runs: one token; qkv with the RMSNorm prologue and
  // the RoPE + KV-cache epilogue, o_proj and down adding to the residual,
  // gate_up with the RMSNorm prologue and SiLU-and-mul, each on the
  // CUDA-core skinny GEMM (kAuto's one-token choice); the attention on the
  // tensor-core split kernel, one query token per request; one head_dim.
  // Writes the layer table and zeroed barrier words into `params.memory`
  // (DecodeMegakernelBytes; a synchronous copy, so not while capturing).
  // InvalidArgument names what does not fit; Unimplemented off CUDA.
  static absl::StatusOr<DecodeMegakernelPlan> Create(
      Stream& stream, const DecodeMegakernelParams& params);

  // One launch: every layer of the step (capturable).
  absl::Status Launch(Stream& stream) const;

  int head_dim() const { return head_dim_; }
  MegakernelReduce reduce() const { return reduce_; }
  int ctas() const { return ctas_; }
  size_t shared_bytes() const { return shared_bytes_; }

 private:
  DeviceBuffer memory_;
  int num_layers_ = 0;
  int head_dim_ = 0;
  int ctas_ = 0;
  size_t shared_bytes_ = 0;
  MegakernelReduce reduce_ = MegakernelReduce::kLastSplit;
};

}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_DECODE_MEGAKERNEL_H_
