#include "worker/kernels/feed_tokens.h"

#include <cstdint>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/feed_tokens_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "feed_sampled_tokens";

void FeedSampledTokensCpu(const FeedSampledTokensParams& p) {
  const int32_t* sampled = p.sampled_token_ids.as<const int32_t>();
  const int32_t* src_rows = p.src_rows.as<const int32_t>();
  int32_t* token_ids = p.token_ids.as<int32_t>();
  const int32_t* dst_indices = p.dst_indices.as<const int32_t>();
  for (int i = 0; i < p.num_feeds; ++i) {
    const int32_t src = src_rows[i];
    const int32_t dst = dst_indices[i];
    if (src < 0 || src >= p.num_sampled || dst < 0 || dst >= p.num_tokens) {
      continue;  // a corrupt entry: never access out of bounds
    }
    token_ids[dst] = sampled[src];
  }
}

#if PDW_HAVE_CUDA
absl::Status FeedSampledTokensOnCuda(Stream& stream,
                                     const FeedSampledTokensParams& p) {
  FeedSampledTokensCudaParams c;
  c.sampled_token_ids = p.sampled_token_ids.as<const int32_t>();
  c.src_rows = p.src_rows.as<const int32_t>();
  c.token_ids = p.token_ids.as<int32_t>();
  c.dst_indices = p.dst_indices.as<const int32_t>();
  c.num_feeds = p.num_feeds;
  c.num_sampled = p.num_sampled;
  c.num_tokens = p.num_tokens;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(LaunchFeedSampledTokensCuda(
                          c, static_cast<cudaStream_t>(ctx.cuda_stream)),
                      kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchFeedSampledTokens(Stream& stream,
                                     const FeedSampledTokensParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(
      kOp,
      "num_feeds is a host value; feed before the step's capture or replay"));
  absl::Status status =
      FirstError({CheckNonNegative(kOp, "num_feeds", p.num_feeds),
                  CheckNonNegative(kOp, "num_sampled", p.num_sampled),
                  CheckNonNegative(kOp, "num_tokens", p.num_tokens)});
  if (!status.ok()) return status;
  const size_t feed_bytes = sizeof(int32_t) * static_cast<size_t>(p.num_feeds);
  const size_t token_bytes =
      sizeof(int32_t) * static_cast<size_t>(p.num_tokens);
  status = FirstError(
      {CheckBuffer(kOp, "sampled_token_ids", p.sampled_token_ids, p.num_sampled,
                   sizeof(int32_t),
                   absl::StrFormat("[num_sampled=%d] int32", p.num_sampled)),
       CheckBuffer(kOp, "src_rows", p.src_rows, p.num_feeds, sizeof(int32_t),
                   absl::StrFormat("[num_feeds=%d] int32", p.num_feeds)),
       CheckBuffer(kOp, "token_ids", p.token_ids, p.num_tokens, sizeof(int32_t),
                   absl::StrFormat("[num_tokens=%d] int32", p.num_tokens)),
       CheckBuffer(kOp, "dst_indices", p.dst_indices, p.num_feeds,
                   sizeof(int32_t),
                   absl::StrFormat("[num_feeds=%d] int32", p.num_feeds)),
       // Everything the op reads must stay put while token_ids is written
       // (in any order on CUDA).
       CheckDisjoint(kOp, "token_ids", p.token_ids, token_bytes,
                     "sampled_token_ids", p.sampled_token_ids,
                     sizeof(int32_t) * static_cast<size_t>(p.num_sampled)),
       CheckDisjoint(kOp, "token_ids", p.token_ids, token_bytes, "src_rows",
                     p.src_rows, feed_bytes),
       CheckDisjoint(kOp, "token_ids", p.token_ids, token_bytes, "dst_indices",
                     p.dst_indices, feed_bytes),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (p.num_feeds == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    return FeedSampledTokensOnCuda(stream, p);
  }
#endif
  return stream.Launch(kOp, [p](const OpContext&) { FeedSampledTokensCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
