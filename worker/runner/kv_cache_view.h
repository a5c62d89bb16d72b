// KvCacheView: a worker's paged KV cache as a transfer sees it — per layer
// one K and one V buffer of [num_blocks, block_size, num_kv_heads, head_dim]
// elements — and the copies between a sequence's tokens and host bytes.
//
// A token's K (or V) row of one layer is `token_bytes` contiguous bytes;
// consecutive tokens are contiguous within a block, so a run of tokens is
// copied block by block. Transfers move tokens, not blocks: two workers with
// different block sizes can hand KV to each other.
#ifndef PDWORKER_WORKER_RUNNER_KV_CACHE_VIEW_H_
#define PDWORKER_WORKER_RUNNER_KV_CACHE_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"

namespace pdworker {

enum class KvCachePart { kKey, kValue };

// What must match between two workers for their KV to be interchangeable
// (besides the model fingerprint). Mirrors v1::KvLayout.
struct KvLayoutInfo {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  std::string dtype;  // "float32" (CPU) or "bfloat16" (CUDA)

  bool operator==(const KvLayoutInfo& o) const {
    return num_layers == o.num_layers && num_kv_heads == o.num_kv_heads &&
           head_dim == o.head_dim && dtype == o.dtype;
  }
  std::string ToString() const;
};

struct KvCacheView {
  KvLayoutInfo layout;
  int32_t block_size = 0;            // tokens per block
  size_t token_bytes = 0;            // one token's K (or V) row of one layer
  std::vector<DeviceBuffer> keys;    // [num_layers]
  std::vector<DeviceBuffer> values;  // [num_layers]
  // The allocation all of the above live in (CUDA IPC exports it whole).
  DeviceBuffer allocation;

  const DeviceBuffer& Buffer(int layer, KvCachePart part) const {
    return part == KvCachePart::kKey ? keys[layer] : values[layer];
  }
  // Bytes of `num_tokens` tokens' K and V over all layers: what one
  // handoff of that many tokens moves.
  int64_t BytesFor(int32_t num_tokens) const {
    return int64_t{num_tokens} * 2 * layout.num_layers *
           static_cast<int64_t>(token_bytes);
  }
};

// Which tokens of which layer part: tokens [first_token, first_token +
// num_tokens) of `seq`, all < seq.num_tokens.
struct KvTokenRun {
  int layer = 0;
  KvCachePart part = KvCachePart::kKey;
  int32_t first_token = 0;
  int32_t num_tokens = 0;
};

// Copies a run into host memory `dst` (run.num_tokens * token_bytes bytes)
// on `stream` and waits for it. INVALID_ARGUMENT for a run outside the
// sequence or the layers.
absl::Status ReadKvTokens(Stream& stream, const KvCacheView& view,
                          const SequenceKv& seq, const KvTokenRun& run,
                          void* dst);
// How CopyKvTokens moves the bytes.
enum class KvCopyMethod {
  // CUDA: one kernel launch for every block, layer and part (up to
  // kKvBlockCopyMaxBlocks blocks per side per launch) where the rows are
  // whole 16-byte units; elsewhere, and on the CPU backend, kPerBlock.
  kAuto,
  // One device-to-device copy per contiguous run (at most a block) per layer
  // part: the reference, and what benchmarks compare against.
  kPerBlock,
};

// Copies tokens [first_token, num_tokens) of every layer's K and V from one
// cache to another on `stream` (device to device; the caches may differ in
// block size; token t goes to token t). Both views must have the same
// layout and token_bytes, 0 <= first_token < num_tokens, and each block
// table must hold num_tokens tokens (INVALID_ARGUMENT before anything is
// copied otherwise).
absl::Status CopyKvTokens(Stream& stream, const KvCacheView& src,
                          const SequenceKv& src_seq, const KvCacheView& dst,
                          const SequenceKv& dst_seq, int32_t num_tokens,
                          KvCopyMethod method = KvCopyMethod::kAuto,
                          int32_t first_token = 0);

// A packed span: tokens [first_token, first_token + num_tokens) of every
// layer's K and V in one buffer of view.BytesFor(num_tokens) bytes, rows
// [layer][K, V][token] back to back (what a KV_CHUNK_LAYOUT_TOKEN_SPAN
// chunk carries). GatherKvSpan packs them from `seq`'s blocks into `packed`
// (device memory, at least that large), ScatterKvSpan unpacks them into
// `seq`'s blocks: one kernel launch on CUDA (per kKvBlockCopyMaxBlocks
// blocks), per-block copies elsewhere, enqueued on `stream`.
// INVALID_ARGUMENT before anything is copied for tokens outside the
// sequence or its block table, or a buffer too small.
absl::Status GatherKvSpan(Stream& stream, const KvCacheView& view,
                          const SequenceKv& seq, int32_t first_token,
                          int32_t num_tokens, DeviceBuffer packed);
absl::Status ScatterKvSpan(Stream& stream, DeviceBuffer packed,
                           const KvCacheView& view, const SequenceKv& seq,
                           int32_t first_token, int32_t num_tokens);

// Copies host bytes `src` into a run of `seq`'s blocks on `stream` (the copy
// is complete, or at least ordered before later work on `stream`, when this
// returns; call stream.Synchronize() before other streams read it).
absl::Status WriteKvTokens(Stream& stream, const KvCacheView& view,
                           const SequenceKv& seq, const KvTokenRun& run,
                           const void* src);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNNER_KV_CACHE_VIEW_H_
