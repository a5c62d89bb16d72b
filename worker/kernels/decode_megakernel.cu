// Every decoder layer of a one-token decode step in one kernel.
//
// Why: at one token the 0.5B shape's step is 24 layers × 6 kernels whose
// weights take 0.2-4 µs each to stream at 4.8 TB/s; each kernel still pays
// its launch, ramp and tail (26.8% of HBM, bench/RESULTS.md). Here the GPU
// holds one resident CTA set (a cooperative launch: every CTA co-resident)
// that walks the layers' phases, separated by a grid-wide barrier instead of
// a kernel boundary, and asks L2 to prefetch the weights of the phases ahead
// at the start of each phase, so HBM keeps streaming through the barriers
// and through the phases that read no weights (attention).
//
// Bits: each phase runs the same CTA bodies as the separate kernels, on the
// same virtual grid (skinny_gemm_cta.cuh, decode_attention_cta.cuh): CTA b
// runs virtual CTAs b, b + G, b + 2G, ... (G = gridDim.x); the attention's
// split CTAs are 128 threads, so each CTA runs two at once, one per half of
// its warps with its own named barrier and shared memory. Every output
// element is therefore the same operation sequence as in the fused
// one-token step of separate kernels: the megakernel and that step give the
// same bits (model_runner_gpu_test asserts it).
//
// Phases of a layer (the barrier after each one makes its writes visible to
// the next): qkv (input RMSNorm prologue, RoPE + KV-cache write epilogue) |
// attention split, each (request, kv head)'s last split reducing it
// (MegakernelReduceCuda::kLastSplit; or a reduce phase of its own) |
// o_proj (+ residual) | gate_up (post-attention RMSNorm prologue,
// SiLU-and-mul) | down (+ residual).
#include <cuda/atomic>

#include "worker/kernels/cuda_common.cuh"
#include "worker/kernels/decode_attention_cta.cuh"
#include "worker/kernels/decode_megakernel_cuda.h"
#include "worker/kernels/skinny_gemm_cta.cuh"

namespace pdworker {
namespace kernels {
namespace {

constexpr int kThreads = cuda::kSkinnyThreads;  // 8 warps

// Grid-wide barrier (all CTAs co-resident). Thread 0 of each CTA arrives
// with a device-scope acq_rel increment after the CTA's writes (the
// __syncthreads before it orders them, the fence makes them visible at
// device scope); the last to arrive resets the count and publishes the next
// generation; the others spin until they see it, then fence, so every
// write before the barrier is visible to every read after it. The state is
// back to count 0 when the barrier ends.
__device__ __forceinline__ void GridSync(MegakernelBarrierState* state) {
  __syncthreads();
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<unsigned int, ::cuda::thread_scope_device> count(
        state->count);
    ::cuda::atomic_ref<unsigned int, ::cuda::thread_scope_device> generation(
        state->generation);
    // The generation cannot move before this CTA arrives.
    const unsigned int current =
        generation.load(::cuda::std::memory_order_acquire);
    __threadfence();
    if (count.fetch_add(1, ::cuda::std::memory_order_acq_rel) ==
        gridDim.x - 1) {
      count.store(0, ::cuda::std::memory_order_relaxed);
      generation.fetch_add(1, ::cuda::std::memory_order_release);
    } else {
      // A CTA that never arrives (a grid the device could not hold at
      // once, which the cooperative launch should have refused) would
      // hang the GPU: after ~10 s at ~2 GHz trap instead, so the launch
      // fails with an error the caller sees.
      const long long start = clock64();
      while (generation.load(::cuda::std::memory_order_acquire) == current) {
        if (clock64() - start > 20'000'000'000LL) __trap();
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// This CTA's share of each range into L2 (sm_90's bulk prefetch; a hint:
// nothing waits for it). Lanes of warp 0 issue 16 KiB pieces.
__device__ __forceinline__ void PrefetchToL2(
    const MegakernelPrefetchRange (&ranges)[kMegakernelPrefetchRanges]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t kPrefetchPiece = 16 * 1024;  // bytes, a multiple of 16
  if (threadIdx.x >= cuda::kWarpSize) return;
  for (int r = 0; r < kMegakernelPrefetchRanges; ++r) {
    const int64_t units = ranges[r].bytes / 16;
    if (units == 0) continue;
    const int64_t per_cta = (units + gridDim.x - 1) / gridDim.x;
    const int64_t begin = blockIdx.x * per_cta * 16;
    const int64_t end = (blockIdx.x + 1) * per_cta < units
                            ? (blockIdx.x + 1) * per_cta * 16
                            : units * 16;
    const char* base = static_cast<const char*>(ranges[r].base);
    for (int64_t at = begin + threadIdx.x * kPrefetchPiece; at < end;
         at += cuda::kWarpSize * kPrefetchPiece) {
      const int64_t left = end - at;
      const unsigned int bytes = static_cast<unsigned int>(
          left < kPrefetchPiece ? left : kPrefetchPiece);
      asm volatile(
          "cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + at),
          "r"(bytes)
          : "memory");
    }
  }
#else
  (void)ranges;
#endif
}

// A skinny GEMM phase: the one-token launch's virtual CTAs, round robin.
template <LinearCudaEpilogue kEpi, bool kNorm>
__device__ __forceinline__ void SkinnyPhase(const LinearCudaParams& p,
                                            int k_split) {
  using Shape = cuda::SkinnyShape<1, kEpi>;
  const int n = cuda::SkinnyGemmCtas<1, kEpi>(p.out_features, k_split);
  for (int cta = blockIdx.x; cta < n; cta += gridDim.x) {
    // X was written by an earlier phase of this kernel (the coherent path).
    cuda::SkinnyGemmCta<1, Shape::R, Shape::U, __nv_bfloat16, kEpi, kNorm,
                        cuda::SkinnyInput::kWrittenByKernel>(p, k_split, cta);
    __syncthreads();  // its epilogue has read `partial` before the next
  }
}

// The attention split phase: virtual CTA v = (request, kv head, split) of
// the split kernel's grid, two at a time per CTA (warps 0-3 and 4-7).
// kLastSplit: each split then counts itself in, and the one that completes
// its (request, kv head) reduces the group's heads with its 128 threads
// (the threadfence-reduction pattern: the splits' workspace writes are
// released by the fence before the count and acquired by the fence after
// it), resetting the counter for the next layer.
template <int kHeadDim>
__device__ __forceinline__ void SplitPhase(const PagedAttentionCudaParams& p,
                                           unsigned char* smem,
                                           unsigned int* counters,
                                           MegakernelReduceCuda reduce) {
  constexpr int kHalfBytes =
      (decode_cta::DecodeTile<kHeadDim>::kSharedBytes + 127) / 128 * 128;
  __shared__ int completes[2];  // per half: this split completed its pair
  const int half = threadIdx.x / decode_cta::kThreads;
  const int tid = threadIdx.x % decode_cta::kThreads;
  const decode_cta::CtaSync sync{1 + half};
  const int k = p.uniform_query_len;
  const int requests = p.num_tokens / k;
  const int per_request = p.num_kv_heads * p.num_splits;
  const int group = p.num_heads / p.num_kv_heads;
  const int n = requests * per_request;
  for (int v = 2 * blockIdx.x + half; v < n; v += 2 * gridDim.x) {
    const int request = v / per_request;
    const int kv_head = v % per_request / p.num_splits;
    const int split = v % p.num_splits;
    decode_cta::MmaDecodeSplitCta<kHeadDim>(p, request, kv_head, split, tid,
                                            smem + half * kHalfBytes, sync);
    // Every thread's workspace writes are done, and the next virtual CTA's
    // copies may overwrite this one's tiles.
    sync();
    if (reduce != MegakernelReduceCuda::kLastSplit) continue;
    if (tid == 0) {
      unsigned int* counter = counters + request * p.num_kv_heads + kv_head;
      __threadfence();
      const bool last = atomicAdd(counter, 1u) == p.num_splits - 1u;
      if (last) {
        atomicExch(counter, 0u);  // read again only after a grid barrier
        __threadfence();
      }
      completes[half] = last;
    }
    sync();
    if (completes[half]) {
      for (int h = 0; h < group; ++h) {
        for (int j = 0; j < k; ++j) {
          decode_cta::DecodeReduceCta(p, request * k + j, kv_head * group + h,
                                      tid, decode_cta::kThreads);
        }
      }
    }
  }
}

__device__ __forceinline__ void ReducePhase(const PagedAttentionCudaParams& p) {
  const int n = p.num_tokens * p.num_heads;
  for (int v = blockIdx.x; v < n; v += gridDim.x) {
    decode_cta::DecodeReduceCta(p, v / p.num_heads, v % p.num_heads,
                                threadIdx.x, kThreads);
  }
}

// Two CTAs per SM where shared memory allows it (head_dim 64: 128
// registers); one at head_dim 128 (twice the K/V tiles).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads, kHeadDim == 64 ? 2 : 1)
    DecodeMegakernel(const DecodeMegakernelCudaParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  using E = LinearCudaEpilogue;
  for (int l = 0; l < p.num_layers; ++l) {
    const DecodeMegakernelLayerCuda& layer = p.layers[l];
    PrefetchToL2(layer.prefetch[0]);
    SkinnyPhase<E::kRopeKvCache, true>(layer.qkv, layer.qkv_k_split);
    GridSync(p.barrier);
    PrefetchToL2(layer.prefetch[1]);
    if (p.reduce == MegakernelReduceCuda::kLastSplit) {
      PrefetchToL2(layer.prefetch[2]);
    }
    SplitPhase<kHeadDim>(layer.attention, smem, p.split_counters, p.reduce);
    GridSync(p.barrier);
    if (p.reduce == MegakernelReduceCuda::kOwnPhase) {
      PrefetchToL2(layer.prefetch[2]);
      ReducePhase(layer.attention);
      GridSync(p.barrier);
    }
    PrefetchToL2(layer.prefetch[3]);
    SkinnyPhase<E::kAddResidual, false>(layer.o_proj, layer.o_proj_k_split);
    GridSync(p.barrier);
    PrefetchToL2(layer.prefetch[4]);
    SkinnyPhase<E::kSiluAndMul, true>(layer.gate_up, layer.gate_up_k_split);
    GridSync(p.barrier);
    PrefetchToL2(layer.prefetch[5]);
    SkinnyPhase<E::kAddResidual, false>(layer.down, layer.down_k_split);
    // The next layer's qkv (or, after the last, the kernel's end) reads
    // the residual down wrote.
    if (l + 1 < p.num_layers) GridSync(p.barrier);
  }
}

template <int kHeadDim>
cudaError_t SetSharedBytes(size_t shared_bytes) {
  // More than 48 KiB of dynamic shared memory must be opted into (not a
  // stream operation: allowed while a graph is captured).
  return cudaFuncSetAttribute(DecodeMegakernel<kHeadDim>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(shared_bytes));
}

template <int kHeadDim>
cudaError_t MaxCtas(size_t shared_bytes, int ctas_per_sm, int* ctas) {
  cudaError_t error = SetSharedBytes<kHeadDim>(shared_bytes);
  if (error != cudaSuccess) return error;
  int device = 0, sms = 0, per_sm = 0;
  error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (error != cudaSuccess) return error;
  error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, DecodeMegakernel<kHeadDim>, kThreads, shared_bytes);
  if (error != cudaSuccess) return error;
  if (ctas_per_sm > 0 && per_sm > ctas_per_sm) per_sm = ctas_per_sm;
  *ctas = per_sm * sms;
  return cudaSuccess;
}

template <int kHeadDim>
cudaError_t Launch(const DecodeMegakernelCudaParams& p, int ctas,
                   size_t shared_bytes, cudaStream_t stream) {
  cudaError_t error = SetSharedBytes<kHeadDim>(shared_bytes);
  if (error != cudaSuccess) return error;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;
  attribute[0].val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, DecodeMegakernel<kHeadDim>, p);
}

}  // namespace

size_t DecodeMegakernelSharedBytes(int head_dim, int max_norm_features) {
  size_t tile = 0;
  if (head_dim == 64) {
    tile = decode_cta::DecodeTile<64>::kSharedBytes;
  } else if (head_dim == 128) {
    tile = decode_cta::DecodeTile<128>::kSharedBytes;
  } else {
    return 0;
  }
  const size_t split = 2 * ((tile + 127) / 128 * 128);
  const size_t norm = sizeof(__nv_bfloat16) * max_norm_features;
  return split > norm ? split : norm;
}

cudaError_t DecodeMegakernelMaxCtas(int head_dim, size_t shared_bytes,
                                    int ctas_per_sm, int* ctas) {
  if (head_dim == 64) return MaxCtas<64>(shared_bytes, ctas_per_sm, ctas);
  if (head_dim == 128) return MaxCtas<128>(shared_bytes, ctas_per_sm, ctas);
  return cudaErrorInvalidValue;
}

cudaError_t LaunchDecodeMegakernelCuda(const DecodeMegakernelCudaParams& p,
                                       int ctas, size_t shared_bytes,
                                       cudaStream_t stream) {
  if (p.layers == nullptr || p.num_layers <= 0 || p.barrier == nullptr ||
      p.split_counters == nullptr || ctas <= 0) {
    return cudaErrorInvalidValue;
  }
  if (p.head_dim == 64) return Launch<64>(p, ctas, shared_bytes, stream);
  if (p.head_dim == 128) return Launch<128>(p, ctas, shared_bytes, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kernels
}  // namespace pdworker
