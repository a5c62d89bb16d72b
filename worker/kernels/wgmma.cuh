// Hopper warpgroup MMA (wgmma, sm_90a) for the tensor-core attention kernel
// paged_attention_wgmma.cu: shared-memory matrix descriptors, the
// fence / commit / wait protocol and the three instruction shapes it issues.
// (nvcc only; a textual header.)
//
// A warpgroup is 4 consecutive warps (128 threads) that issue each wgmma
// together: D[64 × N] (+)= A[64 × 16] · B[16 × N], bf16 in, fp32
// accumulate, asynchronously. Warp w of the group owns D rows [16w, 16w+16);
// within them a thread's registers follow mma.m16n8k16's C fragment per
// n8 tile j: d[j] = {D[g][8j+2c], D[g][8j+2c+1], D[g+8][8j+2c],
// D[g+8][8j+2c+1]} (g = lane / 4, c = lane % 4; PTX ISA, "wgmma
// .m64nNk16 register fragment layout"). A from registers uses
// mma.m16n8k16's A fragment per warp (Mma16816 in cuda_common.cuh).
//
// Shared-memory operands use the 128-byte swizzle: a "panel" holds rows of
// 64 bf16 (128 bytes), and 16-byte chunk c of row r sits at chunk c ^ (r % 8)
// of its row (mma_tile::Swizzled<64>'s layout), with the panel 1024-byte
// aligned (the hardware swizzles absolute address bits 4-6 with 7-9). A
// wider matrix is stored as consecutive panels of 64 columns.
//  - K-major operand (A = Q, B = K: the 16-element k slice is contiguous):
//    8-row groups are 1024 bytes apart (SBO); k step s of a panel starts
//    32·s bytes in.
//  - MN-major operand (B = V, transposed: its N = head dims are contiguous):
//    8-row groups along K (keys) are 1024 bytes apart (SBO); a k step of 16
//    keys starts 2048 bytes further; N spans one panel (LBO: the next panel).
//
// ptxas serializes every wgmma of a kernel (and says so: "Potential
// Performance Loss ... (C75xx)") when it cannot prove the async pipeline
// safe: a wgmma under a branch it cannot show warpgroup-uniform, or a
// register a wgmma reads written by other instructions while one is in
// flight. Build with -Xptxas -v and keep those messages out.
#ifndef PDWORKER_WORKER_KERNELS_WGMMA_CUH_
#define PDWORKER_WORKER_KERNELS_WGMMA_CUH_

#include <cstdint>

// wgmma exists on sm_90a only (not sm_90, not sm_80): other targets compile
// the wrappers to a trap, and the host never launches them there
// (PagedAttentionWgmmaSupports checks the device).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PDW_WGMMA_AVAILABLE 1
#else
#define PDW_WGMMA_AVAILABLE 0
#endif

namespace pdworker {
namespace kernels {
namespace cuda {
namespace wgmma {

constexpr int kWarpGroupThreads = 128;
constexpr int kPanelBytes = 128;  // one 64-element bf16 row of a panel
constexpr uint32_t kGroupStrideBytes = 1024;  // 8 rows of a panel (SBO)

// The descriptor of a 128-byte-swizzled operand starting at shared address
// `address` (a k step into a 1024-byte aligned panel); `leading_bytes` is
// LBO (the next panel, for MN-major operands wider than one panel).
__device__ __forceinline__ uint64_t Descriptor(uint32_t address,
                                               uint32_t leading_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((address & 0x3FFFF) >> 4);              // 0-13
  desc |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;  // 16-29
  desc |= static_cast<uint64_t>(kGroupStrideBytes >> 4) << 32;          // 32-45
  desc |= uint64_t{1} << 62;  // 62-63: 128-byte swizzle; base offset 0
  return desc;
}

// Keeps the compiler from moving reads or writes of an accumulator across a
// wgmma that is still in flight (the hardware writes it asynchronously).
__device__ __forceinline__ void FenceOperand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}
template <int kTiles>
__device__ __forceinline__ void FenceOperands(float (&d)[kTiles][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) FenceOperand(d[j][e]);
  }
}

// Orders this thread's earlier register writes (accumulators, A fragments)
// before the wgmmas that follow; needed before the first wgmma of a batch.
__device__ __forceinline__ void Fence() {
#if PDW_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void Commit() {
#if PDW_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void Wait() {
#if PDW_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Makes this thread's shared-memory writes (cp.async included, once waited
// for) visible to the async proxy wgmma reads its operands through; each
// writer runs it before the barrier that precedes the wgmmas.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
#if PDW_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d (+)= A · B for A 64×16 (descriptor, K-major) and B 16×N (descriptor,
// K-major); `accumulate` 0 overwrites d.
__device__ __forceinline__ void MmaSs(float (&d)[8][4], uint64_t desc_a,
                                      uint64_t desc_b, int accumulate) {
#if PDW_WGMMA_AVAILABLE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  __trap();
#endif
}

__device__ __forceinline__ void MmaSs(float (&d)[16][4], uint64_t desc_a,
                                      uint64_t desc_b, int accumulate) {
#if PDW_WGMMA_AVAILABLE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39,"
      "%40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55,"
      "%56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  __trap();
#endif
}

// d += A · B for A 64×16 from registers (a: mma.m16n8k16's A fragment of
// this warp's 16 rows) and B 16×64 (descriptor, MN-major: transposed).
__device__ __forceinline__ void MmaRsTransB(float (&d)[8][4],
                                            const uint32_t (&a)[4],
                                            uint64_t desc_b, int accumulate) {
#if PDW_WGMMA_AVAILABLE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),
        "r"(accumulate));
#else
  __trap();
#endif
}

}  // namespace wgmma
}  // namespace cuda
}  // namespace kernels
}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_WGMMA_CUH_
