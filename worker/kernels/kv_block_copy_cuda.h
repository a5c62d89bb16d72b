// One launch that copies a run of tokens of every layer's K and V between two
// paged KV caches on the same device (a CUDA IPC import maps the source's
// cache into this process), instead of one cudaMemcpyAsync per block, layer
// and part (4,096 host calls for a 2,048-token prompt of the 1B shape).
// Plain C++ with CUDA runtime types; included only where PDW_HAVE_CUDA.
#ifndef PDWORKER_WORKER_KERNELS_KV_BLOCK_COPY_CUDA_H_
#define PDWORKER_WORKER_KERNELS_KV_BLOCK_COPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pdworker {

// Layer parts (K and V of each layer) one launch covers: 128 layers.
inline constexpr int kKvBlockCopyMaxParts = 256;
// Block ids per side one launch carries; longer runs take several launches.
inline constexpr int kKvBlockCopyMaxBlocks = 1024;

// Everything travels as the kernel's parameter (about 12 KB: CUDA 12.1+
// kernel parameters up to 32 KB), so a copy needs no device scratch and no
// host-to-device upload of its block lists.
struct KvBlockCopyCudaParams {
  // Base of each layer part ([num_blocks, block_size, token_bytes]) on the
  // source and destination side, part i = 2 · layer + (0: K, 1: V).
  const char* src[kKvBlockCopyMaxParts] = {};
  char* dst[kKvBlockCopyMaxParts] = {};
  // Block ids of blocks src_first_block, src_first_block + 1, ... of the
  // source sequence (and likewise for the destination).
  int32_t src_blocks[kKvBlockCopyMaxBlocks] = {};
  int32_t dst_blocks[kKvBlockCopyMaxBlocks] = {};
  int num_parts = 0;
  int src_block_size = 0;
  int dst_block_size = 0;
  int src_first_block = 0;
  int dst_first_block = 0;
  int64_t token_bytes = 0;  // a multiple of 16
  int first_token = 0;      // tokens [first_token, first_token + num_tokens)
  int num_tokens = 0;
  // Token t of the copy is token t - src_token_shift of the source sequence
  // and t - dst_token_shift of the destination (0 for cache to cache; a
  // packed span of tokens [first, ...) is a one-block sequence shifted by
  // `first`). The block lists start at block (first_token - shift) / size.
  int src_token_shift = 0;
  int dst_token_shift = 0;
};

// Grid (ceil(num_tokens / 16), num_parts), 16-byte loads and stores.
cudaError_t LaunchKvBlockCopyCuda(const KvBlockCopyCudaParams& p,
                                  cudaStream_t stream);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KERNELS_KV_BLOCK_COPY_CUDA_H_
