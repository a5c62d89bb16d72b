// Shared-memory tile helpers of the tensor-core attention kernels
// (paged_attention_mma.cu, paged_attention_decode_mma.cu): cp.async copies,
// ldmatrix loads and the XOR swizzle of K/V/Q tiles whose rows are head_dim
// bf16 wide. (nvcc only; a textual header.)
#ifndef PDWORKER_WORKER_KERNELS_MMA_TILE_CUH_
#define PDWORKER_WORKER_KERNELS_MMA_TILE_CUH_

#include <cuda_bf16.h>

#include <cmath>
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

// One thread's share of the online softmax of two query rows (g and g + 8
// of an m16 tile) over a key tile of kKeyTiles n8 tiles, scores in
// mma.m16n8k16's C fragment layout: element e of s[n] is row e / 2, key
// key0 + 8n + 2c + (e & 1) (c = lane % 4). Scales the scores to log2 units,
// masks (when needs_mask) keys that are not real (key_ok[j] == 0) or past
// the row's position, replaces them by exp2(score - running max), and
// updates row_max / row_sum (this thread's share; the quad shares the max).
// Returns in `rescale` the factor the rows' running outputs take. A row that
// has seen only masked keys keeps max -inf: its weights are exp2(-inf) = 0
// (never exp2(-inf - -inf)).
template <int kKeyTiles>
__device__ __forceinline__ void SoftmaxTile(
    float (&s)[kKeyTiles][4], float (&row_max)[2], float (&row_sum)[2],
    float (&rescale)[2], float scale_log2, bool needs_mask,
    const int8_t* key_ok, int key0, const int (&position)[2], int c) {
#pragma unroll
  for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[n][e] * scale_log2;
      if (needs_mask) {
        const int j = 8 * n + 2 * c + (e & 1);
        if (!key_ok[j] || key0 + j > position[e / 2]) v = -INFINITY;
      }
      s[n][e] = v;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m = row_max[h];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      m = fmaxf(m, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    rescale[h] = m == -INFINITY ? 1.0f : exp2f(row_max[h] - m);
    row_max[h] = m;
    const float base = m == -INFINITY ? 0.0f : m;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      s[n][2 * h] = exp2f(s[n][2 * h] - base);
      s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
      sum += s[n][2 * h] + s[n][2 * h + 1];
    }
    row_sum[h] = row_sum[h] * rescale[h] + sum;
  }
}

// Rows g and g + 8 of an output accumulator (C fragments of kTiles n8
// tiles) times their rescale factors.
template <int kTiles>
__device__ __forceinline__ void RescaleRows(float (&o)[kTiles][4],
                                            const float (&rescale)[2]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    o[n][0] *= rescale[0];
    o[n][1] *= rescale[0];
    o[n][2] *= rescale[1];
    o[n][3] *= rescale[1];
  }
}

// The bf16 A fragment of P's 16 keys [16k, 16k + 16) from the scores of
// their two n8 tiles (C fragment layout = A fragment layout, rounded).
template <int kKeyTiles>
__device__ __forceinline__ void PackProbabilities(
    const float (&s)[kKeyTiles][4], int k, uint32_t (&a)[4]) {
  a[0] = PackBf16x2(s[2 * k][0], s[2 * k][1]);
  a[1] = PackBf16x2(s[2 * k][2], s[2 * k][3]);
  a[2] = PackBf16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
  a[3] = PackBf16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
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
