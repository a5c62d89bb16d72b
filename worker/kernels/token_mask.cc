#include "worker/kernels/token_mask.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/token_mask_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kBanTokensOp[] = "ban_tokens";
constexpr char kMaskBelowMaxOp[] = "mask_below_max";
constexpr float kInf = std::numeric_limits<float>::infinity();

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
    logits[static_cast<int64_t>(row) * p.vocab_size + token] = -kInf;
  }
}

// Entries in order; a row listed twice is masked twice, and since masking
// never changes the row's max, the second pass masks what it would alone.
// token_mask.cu makes the same comparisons on the same fp32 values.
void MaskBelowMaxCpu(const MaskBelowMaxParams& p) {
  float* logits = p.logits.as<float>();
  const int32_t* rows = p.rows.as<const int32_t>();
  const float* offsets = p.offsets.as<const float>();
  for (int i = 0; i < p.num_rows; ++i) {
    const int32_t row = rows[i];
    if (row < 0 || row >= p.num_logit_rows) continue;  // never out of bounds
    float* l = logits + static_cast<int64_t>(row) * p.vocab_size;
    const float offset = offsets[i];
    // -inf, NaN and positive offsets mask nothing (NaN fails both tests).
    float threshold = -kInf;
    if (offset <= 0.0f && offset > -kInf) {
      float max = -kInf;  // NaN never wins a '>' comparison: it counts as -inf
      for (int v = 0; v < p.vocab_size; ++v) {
        if (l[v] > max) max = l[v];
      }
      threshold = max + offset;  // <= max: the max always stays
    }
    for (int v = 0; v < p.vocab_size; ++v) {
      if (l[v] < threshold || std::isnan(l[v])) l[v] = -kInf;
    }
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
  return LaunchCudaOp(stream, kBanTokensOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchBanTokensCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kBanTokensOp);
  });
}

absl::Status MaskBelowMaxOnCuda(Stream& stream, const MaskBelowMaxParams& p) {
  MaskBelowMaxCudaParams c;
  c.logits = p.logits.as<float>();
  c.rows = p.rows.as<const int32_t>();
  c.offsets = p.offsets.as<const float>();
  c.num_rows = p.num_rows;
  c.num_logit_rows = p.num_logit_rows;
  c.vocab_size = p.vocab_size;
  return LaunchCudaOp(stream, kMaskBelowMaxOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchMaskBelowMaxCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kMaskBelowMaxOp);
  });
}
#endif

}  // namespace

absl::Status LaunchBanTokens(Stream& stream, const BanTokensParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(
      kBanTokensOp,
      "num_bans is a host value; ban after the step, before sampling"));
  absl::Status status =
      FirstError({CheckNonNegative(kBanTokensOp, "num_bans", p.num_bans),
                  CheckNonNegative(kBanTokensOp, "num_rows", p.num_rows),
                  CheckPositive(kBanTokensOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_rows) * p.vocab_size;
  const size_t ban_bytes = sizeof(int32_t) * static_cast<size_t>(p.num_bans);
  status = FirstError(
      {CheckBuffer(kBanTokensOp, "logits", p.logits, logits_elements,
                   sizeof(float),
                   absl::StrFormat("[num_rows=%d, vocab_size=%d] fp32",
                                   p.num_rows, p.vocab_size)),
       CheckBuffer(kBanTokensOp, "rows", p.rows, p.num_bans, sizeof(int32_t),
                   absl::StrFormat("[num_bans=%d] int32", p.num_bans)),
       CheckBuffer(kBanTokensOp, "token_ids", p.token_ids, p.num_bans,
                   sizeof(int32_t),
                   absl::StrFormat("[num_bans=%d] int32", p.num_bans)),
       // The bans are read while logits are written (in any order on CUDA).
       CheckDisjoint(kBanTokensOp, "logits", p.logits,
                     sizeof(float) * static_cast<size_t>(logits_elements),
                     "rows", p.rows, ban_bytes),
       CheckDisjoint(kBanTokensOp, "logits", p.logits,
                     sizeof(float) * static_cast<size_t>(logits_elements),
                     "token_ids", p.token_ids, ban_bytes),
       CheckBackendImplemented(stream, kBanTokensOp)});
  if (!status.ok()) return status;
  if (p.num_bans == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return BanTokensOnCuda(stream, p);
#endif
  return stream.Launch(kBanTokensOp,
                       [p](const OpContext&) { BanTokensCpu(p); });
}

absl::Status LaunchMaskBelowMax(Stream& stream, const MaskBelowMaxParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(
      kMaskBelowMaxOp,
      "num_rows is a host value; mask after the step, before sampling"));
  absl::Status status = FirstError(
      {CheckNonNegative(kMaskBelowMaxOp, "num_rows", p.num_rows),
       CheckNonNegative(kMaskBelowMaxOp, "num_logit_rows", p.num_logit_rows),
       CheckPositive(kMaskBelowMaxOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_logit_rows) * p.vocab_size;
  const size_t logits_bytes =
      sizeof(float) * static_cast<size_t>(logits_elements);
  const size_t entry_bytes = sizeof(int32_t) * static_cast<size_t>(p.num_rows);
  status = FirstError(
      {CheckBuffer(kMaskBelowMaxOp, "logits", p.logits, logits_elements,
                   sizeof(float),
                   absl::StrFormat("[num_logit_rows=%d, vocab_size=%d] fp32",
                                   p.num_logit_rows, p.vocab_size)),
       CheckBuffer(kMaskBelowMaxOp, "rows", p.rows, p.num_rows, sizeof(int32_t),
                   absl::StrFormat("[num_rows=%d] int32", p.num_rows)),
       CheckBuffer(kMaskBelowMaxOp, "offsets", p.offsets, p.num_rows,
                   sizeof(float),
                   absl::StrFormat("[num_rows=%d] fp32", p.num_rows)),
       // The entries are read while logits are written.
       CheckDisjoint(kMaskBelowMaxOp, "logits", p.logits, logits_bytes, "rows",
                     p.rows, entry_bytes),
       CheckDisjoint(kMaskBelowMaxOp, "logits", p.logits, logits_bytes,
                     "offsets", p.offsets, entry_bytes),
       CheckBackendImplemented(stream, kMaskBelowMaxOp)});
  if (!status.ok()) return status;
  if (p.num_rows == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return MaskBelowMaxOnCuda(stream, p);
#endif
  return stream.Launch(kMaskBelowMaxOp,
                       [p](const OpContext&) { MaskBelowMaxCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
