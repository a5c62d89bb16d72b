#include "worker/transfer/kv_cache_view.h"

#include <algorithm>
#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA

#if PDW_HAVE_CUDA
#include "worker/kernels/kernel_checks.h"
#include "worker/runtime/cuda_status.h"
#include "worker/transfer/kv_block_copy_cuda.h"
#endif

namespace pdworker {
namespace {

absl::Status CheckRun(const KvCacheView& view, const SequenceKv& seq,
                      const KvTokenRun& run) {
  if (run.layer < 0 || run.layer >= view.layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", run.layer, " outside [0, ", view.layout.num_layers, ")"));
  }
  if (run.first_token < 0 || run.num_tokens <= 0 ||
      run.first_token > seq.num_tokens - run.num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens [", run.first_token, ", ",
                     int64_t{run.first_token} + run.num_tokens,
                     ") outside the sequence's ", seq.num_tokens));
  }
  return absl::OkStatus();
}

// Calls copy(block_slice, byte_offset_in_host, bytes) for each piece of the
// run that is contiguous in the cache (at most one block).
template <typename Copy>
absl::Status ForEachBlockPiece(const KvCacheView& view, const SequenceKv& seq,
                               const KvTokenRun& run, Copy copy) {
  const DeviceBuffer& buffer = view.Buffer(run.layer, run.part);
  int32_t token = run.first_token;
  const int32_t end = run.first_token + run.num_tokens;
  size_t host_offset = 0;
  while (token < end) {
    const int32_t within = token % view.block_size;
    const int32_t count = std::min(view.block_size - within, end - token);
    const size_t slot =
        static_cast<size_t>(seq.blocks[token / view.block_size]) *
            view.block_size +
        within;
    const size_t bytes = static_cast<size_t>(count) * view.token_bytes;
    absl::Status copied =
        copy(buffer.Slice(slot * view.token_bytes, bytes), host_offset, bytes);
    if (!copied.ok()) return copied;
    host_offset += bytes;
    token += count;
  }
  return absl::OkStatus();
}

#if PDW_HAVE_CUDA
// The batched CUDA copy (kv_block_copy_cuda.h) of tokens
// [first_token, num_tokens),
// in launches of at most kKvBlockCopyMaxBlocks blocks per side. False when
// the views do not fit it (rows not whole 16-byte units, too many layers).
bool FitsBatchedCopy(const KvCacheView& src, const KvCacheView& dst) {
  if (src.token_bytes % 16 != 0 ||
      2 * src.layout.num_layers > kKvBlockCopyMaxParts) {
    return false;
  }
  for (int layer = 0; layer < src.layout.num_layers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      if (reinterpret_cast<uintptr_t>(src.Buffer(layer, part).data()) % 16 !=
              0 ||
          reinterpret_cast<uintptr_t>(dst.Buffer(layer, part).data()) % 16 !=
              0) {
        return false;
      }
    }
  }
  return true;
}

absl::Status BatchedCopyKvTokens(Stream& stream, const KvCacheView& src,
                                 const SequenceKv& src_seq,
                                 const KvCacheView& dst,
                                 const SequenceKv& dst_seq, int32_t first_token,
                                 int32_t num_tokens) {
  // Shared by every launch: the part pointers (~4 KB); the block lists are
  // refilled per launch.
  auto p = std::make_unique<KvBlockCopyCudaParams>();
  p->num_parts = 2 * src.layout.num_layers;
  for (int layer = 0; layer < src.layout.num_layers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      const int i = 2 * layer + (part == KvCachePart::kKey ? 0 : 1);
      p->src[i] = static_cast<const char*>(src.Buffer(layer, part).data());
      p->dst[i] = static_cast<char*>(dst.Buffer(layer, part).data());
    }
  }
  p->src_block_size = src.block_size;
  p->dst_block_size = dst.block_size;
  p->token_bytes = static_cast<int64_t>(src.token_bytes);
  // A launch spans at most kKvBlockCopyMaxBlocks blocks on either side
  // wherever it starts within a block.
  const int32_t per_launch =
      (kKvBlockCopyMaxBlocks - 1) * std::min(src.block_size, dst.block_size);
  for (int32_t first = first_token; first < num_tokens; first += per_launch) {
    const int32_t last = std::min(num_tokens, first + per_launch) - 1;
    p->first_token = first;
    p->num_tokens = last - first + 1;
    p->src_first_block = first / src.block_size;
    p->dst_first_block = first / dst.block_size;
    std::copy(src_seq.blocks.begin() + p->src_first_block,
              src_seq.blocks.begin() + last / src.block_size + 1,
              p->src_blocks);
    std::copy(dst_seq.blocks.begin() + p->dst_first_block,
              dst_seq.blocks.begin() + last / dst.block_size + 1,
              p->dst_blocks);
    const KvBlockCopyCudaParams* params = p.get();
    absl::Status launched = kernels::LaunchCudaOp(
        stream, "kv_block_copy", [params](const OpContext& ctx) {
          return CudaStatus(
              LaunchKvBlockCopyCuda(*params,
                                    static_cast<cudaStream_t>(ctx.cuda_stream)),
              "kv_block_copy");
        });
    if (!launched.ok()) return launched;
  }
  return absl::OkStatus();
}
#endif  // PDW_HAVE_CUDA

}  // namespace

std::string KvLayoutInfo::ToString() const {
  return absl::StrCat(num_layers, " layers x ", num_kv_heads, " KV heads x ",
                      head_dim, " (", dtype, ")");
}

absl::Status ReadKvTokens(Stream& stream, const KvCacheView& view,
                          const SequenceKv& seq, const KvTokenRun& run,
                          void* dst) {
  absl::Status valid = CheckRun(view, seq, run);
  if (!valid.ok()) return valid;
  char* out = static_cast<char*>(dst);
  return ForEachBlockPiece(
      view, seq, run, [&](DeviceBuffer piece, size_t offset, size_t bytes) {
        return stream.CopyToHost(out + offset, piece, bytes);
      });
}

absl::Status WriteKvTokens(Stream& stream, const KvCacheView& view,
                           const SequenceKv& seq, const KvTokenRun& run,
                           const void* src) {
  absl::Status valid = CheckRun(view, seq, run);
  if (!valid.ok()) return valid;
  const char* in = static_cast<const char*>(src);
  return ForEachBlockPiece(
      view, seq, run, [&](DeviceBuffer piece, size_t offset, size_t bytes) {
        return stream.CopyToDevice(piece, in + offset, bytes);
      });
}

absl::Status CopyKvTokens(Stream& stream, const KvCacheView& src,
                          const SequenceKv& src_seq, const KvCacheView& dst,
                          const SequenceKv& dst_seq, int32_t num_tokens,
                          KvCopyMethod method, int32_t first_token) {
  if (!(src.layout == dst.layout) || src.token_bytes != dst.token_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV layouts differ: ", src.layout.ToString(), " vs ",
                     dst.layout.ToString()));
  }
  if (num_tokens <= 0 || num_tokens > src_seq.num_tokens ||
      num_tokens > dst_seq.num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot copy ", num_tokens, " tokens from ",
                     src_seq.num_tokens, " into ", dst_seq.num_tokens));
  }
  if (first_token < 0 || first_token >= num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_token=", first_token, " outside [0, ", num_tokens, ")"));
  }
  const int64_t src_blocks = (num_tokens + src.block_size - 1) / src.block_size;
  const int64_t dst_blocks = (num_tokens + dst.block_size - 1) / dst.block_size;
  if (static_cast<int64_t>(src_seq.blocks.size()) < src_blocks ||
      static_cast<int64_t>(dst_seq.blocks.size()) < dst_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block tables of ", src_seq.blocks.size(), " / ", dst_seq.blocks.size(),
        " blocks cannot hold ", num_tokens, " tokens"));
  }
#if PDW_HAVE_CUDA
  if (method == KvCopyMethod::kAuto && stream.kind() == DeviceKind::kCuda &&
      FitsBatchedCopy(src, dst)) {
    return BatchedCopyKvTokens(stream, src, src_seq, dst, dst_seq, first_token,
                               num_tokens);
  }
#else
  static_cast<void>(method);  // without CUDA every copy is per block
#endif
  for (int layer = 0; layer < src.layout.num_layers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      const DeviceBuffer& from = src.Buffer(layer, part);
      const DeviceBuffer& to = dst.Buffer(layer, part);
      int32_t token = first_token;
      // Runs contiguous on both sides: bounded by either side's block end.
      while (token < num_tokens) {
        const int32_t src_within = token % src.block_size;
        const int32_t dst_within = token % dst.block_size;
        const int32_t count =
            std::min({src.block_size - src_within, dst.block_size - dst_within,
                      num_tokens - token});
        const size_t src_slot =
            static_cast<size_t>(src_seq.blocks[token / src.block_size]) *
                src.block_size +
            src_within;
        const size_t dst_slot =
            static_cast<size_t>(dst_seq.blocks[token / dst.block_size]) *
                dst.block_size +
            dst_within;
        const size_t bytes = static_cast<size_t>(count) * src.token_bytes;
        absl::Status copied = stream.CopyOnDevice(
            to.Slice(dst_slot * dst.token_bytes, bytes),
            from.Slice(src_slot * src.token_bytes, bytes), bytes);
        if (!copied.ok()) return copied;
        token += count;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pdworker
