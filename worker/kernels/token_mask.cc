#include "worker/kernels/token_mask.h"

#include <cstdint>
#include <limits>

#include "absl/strings/str_format.h"
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/token_mask_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "ban_tokens";

void BanTokensCpu(const BanTokensParams& p) {
  float* logits = p.logits.as<float>();
  const int32_t* rows = p.rows.as<const int32_t>();
  const int32_t* token_ids = p.token_ids.as<const int32_t>();
  for (int i = 0; i < p.num_bans; ++i) {
    const int32_t row = rows[i];
    const int32_t token = token_ids[i];
    if (row < 0 || row >= p.num_rows || token < 0 || token >= p.vocab_size) {
      continue;  // a corrupt entry: never write out of bounds
    }
    logits[static_cast<int64_t>(row) * p.vocab_size + token] =
        -std::numeric_limits<float>::infinity();
  }
}

#if PDW_HAVE_CUDA
absl::Status BanTokensOnCuda(Stream& stream, const BanTokensParams& p) {
  BanTokensCudaParams c;
  c.logits = p.logits.as<float>();
  c.rows = p.rows.as<const int32_t>();
  c.token_ids = p.token_ids.as<const int32_t>();
  c.num_bans = p.num_bans;
  c.num_rows = p.num_rows;
  c.vocab_size = p.vocab_size;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchBanTokensCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchBanTokens(Stream& stream, const BanTokensParams& p) {
  if (stream.IsCapturing()) {
    stream.InvalidateCapture(kOp);
    return absl::FailedPreconditionError(
        "ban_tokens: must not be captured into a graph (num_bans is a host "
        "value); ban after the step, before sampling. The capture is now "
        "invalid.");
  }
  absl::Status status =
      FirstError({CheckNonNegative(kOp, "num_bans", p.num_bans),
                  CheckNonNegative(kOp, "num_rows", p.num_rows),
                  CheckPositive(kOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_rows) * p.vocab_size;
  const size_t ban_bytes = sizeof(int32_t) * static_cast<size_t>(p.num_bans);
  status = FirstError(
      {CheckBuffer(kOp, "logits", p.logits, logits_elements, sizeof(float),
                   absl::StrFormat("[num_rows=%d, vocab_size=%d] fp32",
                                   p.num_rows, p.vocab_size)),
       CheckBuffer(kOp, "rows", p.rows, p.num_bans, sizeof(int32_t),
                   absl::StrFormat("[num_bans=%d] int32", p.num_bans)),
       CheckBuffer(kOp, "token_ids", p.token_ids, p.num_bans, sizeof(int32_t),
                   absl::StrFormat("[num_bans=%d] int32", p.num_bans)),
       // The bans are read while logits are written (in any order on CUDA).
       CheckDisjoint(kOp, "logits", p.logits,
                     sizeof(float) * static_cast<size_t>(logits_elements),
                     "rows", p.rows, ban_bytes),
       CheckDisjoint(kOp, "logits", p.logits,
                     sizeof(float) * static_cast<size_t>(logits_elements),
                     "token_ids", p.token_ids, ban_bytes),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (p.num_bans == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return BanTokensOnCuda(stream, p);
#endif
  return stream.Launch(kOp, [p](const OpContext&) { BanTokensCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
