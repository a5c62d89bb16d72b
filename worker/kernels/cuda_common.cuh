// Device-side helpers shared by the CUDA kernels in worker/kernels/*.cu
// (nvcc only; a textual header of each cuda_library).
//
// Conventions of every kernel here:
//  - bf16 storage, fp32 arithmetic: values are widened with ToFloat, the
//    math runs in fp32 and the result is rounded once with FromFloat
//    (__float2bfloat16: round to nearest even, as the host's
//    FloatToBFloat16Bits).
//  - Determinism: no floating-point atomics; every reduction has a fixed
//    shape (shuffle-down tree, then warp 0 over the per-warp partials), so a
//    kernel launched twice on the same inputs, eagerly or inside a replayed
//    graph, writes the same bits.
//  - Grids depend only on the launch's fixed shape (padded token count,
//    heads, ...), never on device data: step metadata (lengths, slots, block
//    tables) is read by the kernels, so a captured graph serves every step.
#ifndef PDWORKER_WORKER_KERNELS_CUDA_COMMON_CUH_
#define PDWORKER_WORKER_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdworker {
namespace kernels {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned int kFullMask = 0xffffffffu;

// Blocks of `per_block` covering `n` items (at least 1 so a launch is valid).
inline unsigned int NumBlocks(int64_t n, int64_t per_block) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks > 0 ? blocks : 1);
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);  // round to nearest even
}

// Programmatic dependent launch: lets the next kernel in the stream, if it
// was launched with programmatic stream serialization (the skinny GEMM of a
// decode step's linears), be scheduled now, so it can issue its weight
// loads while this grid runs. It still waits (griddepcontrol.wait) for this
// whole grid to finish, writes flushed, before reading any of its input. A
// no-op for dependents launched without the attribute, and below sm_90.
// Called first thing by the kernels that precede a linear in a decode step.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The other side of AllowDependentLaunch: returns once the previous kernel in
// the stream has finished and its writes are visible. A kernel launched with
// programmatic stream serialization calls it before reading anything the
// previous kernel writes (it may issue loads of constant data, weights,
// before it). Launched without the attribute it returns at once.
__device__ __forceinline__ void WaitForPreviousKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Where a launch may overlap the previous kernel (LaunchKernel).
enum class DependentLaunch { kSerialized, kProgrammatic };

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with
// kProgrammatic through cudaLaunchKernelEx and programmatic stream
// serialization: the kernel may be scheduled while the previous one drains
// (its AllowDependentLaunch) and must WaitForPreviousKernel before reading
// what that one writes. Returns the launch error.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block,
                         size_t shared_bytes, cudaStream_t stream,
                         DependentLaunch dependent, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = dependent == DependentLaunch::kProgrammatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

// A two-buffer software pipeline over `num` items (a warp's k chunks) in
// groups of `group`: group g + 1's loads are issued before group g is
// consumed, so the loads stay in flight while the warp computes. The
// caller has loaded group 0 into `a` and group 1 into `b` (both before
// WaitForPreviousKernel: a one-token decode layer's warp has at most 2
// groups, so all of its weights are in flight before the previous kernel
// ends; loads past `num` must be guarded by `load`). Groups are consumed in
// order: the same operation sequence as one buffer. load(buffer, first) and
// consume(buffer, first) take a buffer by reference.
template <typename Buffer, typename Load, typename Consume>
__device__ __forceinline__ void PingPong(int num, int group, Buffer& a,
                                         Buffer& b, const Load& load,
                                         const Consume& consume) {
  for (int first = 0; first < num; first += 2 * group) {
    const bool second = first + group < num;
    if (first > 0 && second) load(b, first + group);
    consume(a, first);
    if (first + 2 * group < num) load(a, first + 2 * group);
    if (second) consume(b, first + group);
  }
}

// A 16-byte load of data read once per kernel (a decode step's weights):
// through the read-only path, not allocated in L1, so the activations every
// warp re-reads stay there.
__device__ __forceinline__ uint4 LoadStreaming(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// d += a · b for one 16×8×16 bf16 tile on the tensor cores (sm_80+; a:
// 16×16 row-major fragment, b: 16×8 column-major fragment, d: 16×8 fp32).
// Fragment of lane l, g = l / 4, c = l % 4 (PTX ISA, mma.m16n8k16):
//   a[0] = A[g][2c, 2c+1]     a[1] = A[g+8][2c, 2c+1]
//   a[2] = A[g][2c+8, 2c+9]   a[3] = A[g+8][2c+8, 2c+9]
//   b0 = B[2c, 2c+1][g]       b1 = B[2c+8, 2c+9][g]
//   d = {D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]}
// D[i][j] depends on row i of A and column j of B only.
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// silu(gate) · up, the expression of the CPU kernel (worker/kernels/
// silu_and_mul.cc): gate / (1 + exp(-gate)) · up with the accurate expf (for
// gate -> -inf, exp overflows to inf and the quotient is -0, no NaN). One
// definition for the SiLU-and-mul kernel and the skinny GEMM's fused
// epilogue, so the two give the same bits.
__device__ __forceinline__ float SiluMul(float gate, float up) {
  return gate / (1.0f + expf(-gate)) * up;
}

// GeGLU's gelu_tanh(gate) · up, the CPU kernel's expression
// (gelu_tanh_and_mul.cc): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
__device__ __forceinline__ float GeluTanhMul(float gate, float up) {
  const float inner =
      0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
  return 0.5f * gate * (1.0f + tanhf(inner)) * up;
}

// True when `p` may be read or written with 16-byte (uint4) accesses.
inline bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The 8 bf16 of a 16-byte load as floats, exactly (a bf16 is the top half of
// the fp32 of equal value; element 2i is the low half of word i).
__device__ __forceinline__ void Bf16x8ToFloat(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Sum over the warp, valid in lane 0 only (shuffle-down tree: a fixed order).
__device__ __forceinline__ float WarpSumToLane0(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(kFullMask, v, offset);
  }
  return v;
}

// Sum over the warp, the same value in every lane (lane 0's, broadcast:
// a butterfly would give lanes differently rounded sums).
__device__ __forceinline__ float WarpSum(float v) {
  return __shfl_sync(kFullMask, WarpSumToLane0(v), 0);
}

// Max over the warp, in every lane (max is exact, any order will do).
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Sum over the whole block, returned to every thread. blockDim.x must be a
// multiple of 32 (<= 1024); every thread of the block must call it.
// `scratch` is __shared__ float[32]; it may be reused after the call.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpSumToLane0(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float partial = lane < num_warps ? scratch[lane] : 0.0f;
    partial = WarpSumToLane0(partial);
    if (lane == 0) scratch[0] = partial;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();  // everyone has read scratch[0] before it is reused
  return total;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_CUDA_COMMON_CUH_
