// Shared-memory tile helpers of the tensor-core attention kernels
// (paged_attention_mma.cu, paged_attention_decode_mma.cu): cp.async copies,
// ldmatrix loads and the XOR swizzle of K/V/Q tiles whose rows are head_dim
// bf16 wide. (nvcc only; a textual header.)
#ifndef PDWORKER_WORKER_KERNELS_MMA_TILE_CUH_
#define PDWORKER_WORKER_KERNELS_MMA_TILE_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace pdworker {
namespace kernels {
namespace cuda {
namespace mma_tile {

constexpr int kChunk = 8;  // bf16 per 16-byte chunk

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes 0 zero-fills the destination.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src,
                                            int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CommitCopies() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4],
                                                  uint32_t addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
      "[%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of
// rows kHeadDim elements wide.
template <int kHeadDim>
__device__ __forceinline__ int Swizzled(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) * kChunk);
}

}  // namespace mma_tile
}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_MMA_TILE_CUH_
