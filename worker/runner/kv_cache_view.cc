#include "worker/runner/kv_cache_view.h"

#include <algorithm>
#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA

#if PDW_HAVE_CUDA
#include "worker/kernels/kernel_checks.h"
#include "worker/kernels/kv_block_copy_cuda.h"
#include "worker/runtime/cuda_status.h"
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

// One side of a token copy: token t of the copy is token t - token_shift
// of `seq` in `view` (shift 0 between caches; a packed span of tokens
// [first, ...) is a one-block sequence shifted by `first`).
struct KvCopySide {
  const KvCacheView* view = nullptr;
  const SequenceKv* seq = nullptr;
  int32_t token_shift = 0;

  // The cache slot (block id * block_size + offset) of copy token `token`.
  size_t Slot(int32_t token) const {
    const int32_t t = token - token_shift;
    return static_cast<size_t>(seq->blocks[t / view->block_size]) *
               view->block_size +
           t % view->block_size;
  }
  // Tokens from copy token `token` to the end of its block.
  int32_t LeftInBlock(int32_t token) const {
    return view->block_size - (token - token_shift) % view->block_size;
  }
};

#if PDW_HAVE_CUDA
// The batched CUDA copy (kv_block_copy_cuda.h) of copy tokens [first, end),
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

absl::Status BatchedCopy(Stream& stream, const KvCopySide& src,
                         const KvCopySide& dst, int32_t first, int32_t end) {
  // Shared by every launch: the part pointers (~4 KB); the block lists are
  // refilled per launch.
  auto p = std::make_unique<KvBlockCopyCudaParams>();
  const int num_layers = src.view->layout.num_layers;
  p->num_parts = 2 * num_layers;
  for (int layer = 0; layer < num_layers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      const int i = 2 * layer + (part == KvCachePart::kKey ? 0 : 1);
      p->src[i] =
          static_cast<const char*>(src.view->Buffer(layer, part).data());
      p->dst[i] = static_cast<char*>(dst.view->Buffer(layer, part).data());
    }
  }
  p->src_block_size = src.view->block_size;
  p->dst_block_size = dst.view->block_size;
  p->token_bytes = static_cast<int64_t>(src.view->token_bytes);
  p->src_token_shift = src.token_shift;
  p->dst_token_shift = dst.token_shift;
  // A launch spans at most kKvBlockCopyMaxBlocks blocks on either side
  // wherever it starts within a block.
  const int32_t per_launch =
      (kKvBlockCopyMaxBlocks - 1) *
      std::min(src.view->block_size, dst.view->block_size);
  for (int32_t from = first; from < end; from += per_launch) {
    const int32_t last = std::min(end, from + per_launch) - 1;
    p->first_token = from;
    p->num_tokens = last - from + 1;
    const auto fill = [&](const KvCopySide& side, int* first_block,
                          int32_t* blocks) {
      const int32_t bs = side.view->block_size;
      *first_block = (from - side.token_shift) / bs;
      std::copy(side.seq->blocks.begin() + *first_block,
                side.seq->blocks.begin() + (last - side.token_shift) / bs + 1,
                blocks);
    };
    fill(src, &p->src_first_block, p->src_blocks);
    fill(dst, &p->dst_first_block, p->dst_blocks);
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

// Copies copy tokens [first, end) of every layer's K and V from `src` to
// `dst` (arguments checked by the callers).
absl::Status CopyTokens(Stream& stream, const KvCopySide& src,
                        const KvCopySide& dst, int32_t first, int32_t end,
                        KvCopyMethod method) {
#if PDW_HAVE_CUDA
  if (method == KvCopyMethod::kAuto && stream.kind() == DeviceKind::kCuda &&
      FitsBatchedCopy(*src.view, *dst.view)) {
    return BatchedCopy(stream, src, dst, first, end);
  }
#else
  static_cast<void>(method);  // without CUDA every copy is per block
#endif
  const size_t token_bytes = src.view->token_bytes;
  for (int layer = 0; layer < src.view->layout.num_layers; ++layer) {
    for (const KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      const DeviceBuffer& from = src.view->Buffer(layer, part);
      const DeviceBuffer& to = dst.view->Buffer(layer, part);
      int32_t token = first;
      // Runs contiguous on both sides: bounded by either side's block end.
      while (token < end) {
        const int32_t count = std::min(
            {src.LeftInBlock(token), dst.LeftInBlock(token), end - token});
        const size_t bytes = static_cast<size_t>(count) * token_bytes;
        absl::Status copied = stream.CopyOnDevice(
            to.Slice(dst.Slot(token) * token_bytes, bytes),
            from.Slice(src.Slot(token) * token_bytes, bytes), bytes);
        if (!copied.ok()) return copied;
        token += count;
      }
    }
  }
  return absl::OkStatus();
}

// A packed span buffer as a cache of one block of `num_tokens` tokens per
// layer part, part 2 * layer + (K: 0, V: 1) at part * num_tokens *
// token_bytes: the rows [layer][K, V][token] back to back.
KvCacheView PackedSpanView(const KvCacheView& like, DeviceBuffer packed,
                           int32_t num_tokens) {
  KvCacheView view;
  view.layout = like.layout;
  view.block_size = num_tokens;
  view.token_bytes = like.token_bytes;
  view.allocation = packed;
  const size_t part = static_cast<size_t>(num_tokens) * like.token_bytes;
  for (int l = 0; l < like.layout.num_layers; ++l) {
    view.keys.push_back(packed.Slice(2 * l * part, part));
    view.values.push_back(packed.Slice((2 * l + 1) * part, part));
  }
  return view;
}

// Checks the arguments of GatherKvSpan / ScatterKvSpan.
absl::Status CheckSpan(const KvCacheView& view, const SequenceKv& seq,
                       int32_t first_token, int32_t num_tokens,
                       const DeviceBuffer& packed) {
  if (first_token < 0 || num_tokens <= 0 ||
      first_token > seq.num_tokens - num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens [", first_token, ", ", int64_t{first_token} + num_tokens,
        ") outside the sequence's ", seq.num_tokens));
  }
  const int64_t blocks =
      (int64_t{first_token} + num_tokens + view.block_size - 1) /
      view.block_size;
  if (static_cast<int64_t>(seq.blocks.size()) < blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a block table of ", seq.blocks.size(), " blocks cannot hold ",
        first_token + num_tokens, " tokens"));
  }
  if (static_cast<int64_t>(packed.size_bytes()) < view.BytesFor(num_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a packed span of ", num_tokens, " tokens needs ",
                     view.BytesFor(num_tokens), " bytes, the buffer has ",
                     packed.size_bytes()));
  }
  return absl::OkStatus();
}

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
  const KvCopySide from{&src, &src_seq, 0};
  const KvCopySide to{&dst, &dst_seq, 0};
  return CopyTokens(stream, from, to, first_token, num_tokens, method);
}

namespace {

enum class SpanDirection { kPack, kUnpack };

// Copies tokens [first_token, first_token + num_tokens) of `seq` into the
// packed span (kPack) or out of it (kUnpack).
absl::Status CopySpan(Stream& stream, const KvCacheView& view,
                      const SequenceKv& seq, int32_t first_token,
                      int32_t num_tokens, DeviceBuffer packed,
                      SpanDirection direction) {
  PDW_RETURN_IF_ERROR(CheckSpan(view, seq, first_token, num_tokens, packed));
  const KvCacheView packed_view = PackedSpanView(view, packed, num_tokens);
  SequenceKv packed_seq;
  packed_seq.blocks = {0};
  packed_seq.num_tokens = num_tokens;
  const KvCopySide cache{&view, &seq, 0};
  const KvCopySide span{&packed_view, &packed_seq, first_token};
  const bool pack = direction == SpanDirection::kPack;
  return CopyTokens(stream, pack ? cache : span, pack ? span : cache,
                    first_token, first_token + num_tokens, KvCopyMethod::kAuto);
}

}  // namespace

absl::Status GatherKvSpan(Stream& stream, const KvCacheView& view,
                          const SequenceKv& seq, int32_t first_token,
                          int32_t num_tokens, DeviceBuffer packed) {
  return CopySpan(stream, view, seq, first_token, num_tokens, packed,
                  SpanDirection::kPack);
}

absl::Status ScatterKvSpan(Stream& stream, DeviceBuffer packed,
                           const KvCacheView& view, const SequenceKv& seq,
                           int32_t first_token, int32_t num_tokens) {
  return CopySpan(stream, view, seq, first_token, num_tokens, packed,
                  SpanDirection::kUnpack);
}

}  // namespace pdworker
