#include "worker/kernels/logprobs.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/logprobs_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kTopOp[] = "top_logprobs";
constexpr char kGatherOp[] = "gather_logprobs";
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// NaN logits count as -inf (as in sampling.cc): never chosen before a real
// logit, no probability mass.
inline float Logit(const float* row, int32_t id) {
  const float v = row[id];
  return std::isnan(v) ? kNegInf : v;
}

// logit - logsumexp in fp32 (both ops use exactly this, so their bits
// agree); a row without mass (logsumexp -inf) has logprob -inf everywhere
// instead of inf - inf.
inline float Logprob(float logit, float logsumexp) {
  return logsumexp == kNegInf ? kNegInf : logit - logsumexp;
}

// log(sum_v exp(row[v])) in double, max-subtracted, rounded once to fp32.
float RowLogsumexp(const float* row, int vocab) {
  float max = kNegInf;
  for (int v = 0; v < vocab; ++v) max = std::max(max, Logit(row, v));
  if (std::isinf(max)) return max;  // all -inf: -inf; a +inf logit: +inf
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(double{Logit(row, v)} - max);
  return static_cast<float>(double{max} + std::log(sum));
}

// The k (<= kMaxTopLogprobs) best ids of `row` in (logit descending, id
// ascending) order, by insertion into a sorted list: ids are visited in
// ascending order, so an equal logit never moves ahead of an earlier id.
void RowTopK(const float* row, int vocab, int k, float logsumexp,
             int32_t* top_ids, float* top_logprobs) {
  float best[kMaxTopLogprobs] = {};
  int32_t best_ids[kMaxTopLogprobs] = {};
  int count = 0;
  for (int v = 0; v < vocab; ++v) {
    const float l = Logit(row, v);
    if (count == k && !(l > best[k - 1])) continue;
    int at = count < k ? count++ : k - 1;  // the full list drops its last
    for (; at > 0 && l > best[at - 1]; --at) {
      best[at] = best[at - 1];
      best_ids[at] = best_ids[at - 1];
    }
    best[at] = l;
    best_ids[at] = v;
  }
  for (int j = 0; j < k; ++j) {
    top_ids[j] = best_ids[j];
    top_logprobs[j] = Logprob(best[j], logsumexp);
  }
}

void TopLogprobsCpu(const TopLogprobsParams& p) {
  const float* logits = p.logits.as<const float>();
  const int32_t* rows = p.rows.as<const int32_t>();
  float* logsumexp = p.logsumexp.as<float>();
  int32_t* top_ids = p.top_token_ids.as<int32_t>();
  float* top_logprobs = p.top_logprobs.as<float>();
  for (int i = 0; i < p.num_rows; ++i) {
    const int32_t r = rows[i];
    const int64_t out = static_cast<int64_t>(i) * p.k;
    if (r < 0 || r >= p.num_logit_rows) {  // a corrupt entry: read nothing
      logsumexp[i] = kNegInf;
      std::fill(top_ids + out, top_ids + out + p.k, -1);
      std::fill(top_logprobs + out, top_logprobs + out + p.k, kNegInf);
      continue;
    }
    const float* row = logits + static_cast<int64_t>(r) * p.vocab_size;
    logsumexp[i] = RowLogsumexp(row, p.vocab_size);
    if (p.k > 0) {
      RowTopK(row, p.vocab_size, p.k, logsumexp[i], top_ids + out,
              top_logprobs + out);
    }
  }
}

void GatherLogprobsCpu(const GatherLogprobsParams& p) {
  const float* logits = p.logits.as<const float>();
  const int32_t* rows = p.rows.as<const int32_t>();
  const int32_t* token_ids = p.token_ids.as<const int32_t>();
  const float* logsumexp = p.logsumexp.as<const float>();
  float* logprobs = p.logprobs.as<float>();
  for (int i = 0; i < p.num_rows; ++i) {
    const int32_t r = rows[i];
    if (r < 0 || r >= p.num_logit_rows) {
      logprobs[i] = kNegInf;  // a corrupt row: never read out of bounds
      continue;
    }
    const int32_t token = token_ids[r];
    if (token < 0 || token >= p.vocab_size) {
      logprobs[i] = kNegInf;  // a corrupt token id
      continue;
    }
    logprobs[i] =
        Logprob(Logit(logits + static_cast<int64_t>(r) * p.vocab_size, token),
                logsumexp[i]);
  }
}

#if PDW_HAVE_CUDA
absl::Status TopLogprobsOnCuda(Stream& stream, const TopLogprobsParams& p) {
  TopLogprobsCudaParams c;
  c.logits = p.logits.as<const float>();
  c.rows = p.rows.as<const int32_t>();
  c.logsumexp = p.logsumexp.as<float>();
  c.top_token_ids = p.top_token_ids.as<int32_t>();
  c.top_logprobs = p.top_logprobs.as<float>();
  c.num_rows = p.num_rows;
  c.num_logit_rows = p.num_logit_rows;
  c.vocab_size = p.vocab_size;
  c.k = p.k;
  return LaunchCudaOp(stream, kTopOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchTopLogprobsCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kTopOp);
  });
}

absl::Status GatherLogprobsOnCuda(Stream& stream,
                                  const GatherLogprobsParams& p) {
  GatherLogprobsCudaParams c;
  c.logits = p.logits.as<const float>();
  c.rows = p.rows.as<const int32_t>();
  c.token_ids = p.token_ids.as<const int32_t>();
  c.logsumexp = p.logsumexp.as<const float>();
  c.logprobs = p.logprobs.as<float>();
  c.num_rows = p.num_rows;
  c.num_logit_rows = p.num_logit_rows;
  c.vocab_size = p.vocab_size;
  return LaunchCudaOp(stream, kGatherOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchGatherLogprobsCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kGatherOp);
  });
}
#endif

constexpr char kHostRows[] =
    "num_rows is a host value; compute logprobs after the step";

}  // namespace

absl::Status LaunchTopLogprobs(Stream& stream, const TopLogprobsParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(kTopOp, kHostRows));
  absl::Status status =
      FirstError({CheckNonNegative(kTopOp, "num_rows", p.num_rows),
                  CheckNonNegative(kTopOp, "num_logit_rows", p.num_logit_rows),
                  CheckPositive(kTopOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int max_k = std::min(kMaxTopLogprobs, p.vocab_size);
  if (p.k < 0 || p.k > max_k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: k must be in [0, min(kMaxTopLogprobs=%d, vocab_size=%d)], got %d",
        kTopOp, kMaxTopLogprobs, p.vocab_size, p.k));
  }
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_logit_rows) * p.vocab_size;
  const int64_t top_elements = static_cast<int64_t>(p.num_rows) * p.k;
  const size_t logits_bytes =
      sizeof(float) * static_cast<size_t>(logits_elements);
  const size_t row_bytes = sizeof(int32_t) * static_cast<size_t>(p.num_rows);
  const size_t lse_bytes = sizeof(float) * static_cast<size_t>(p.num_rows);
  const size_t ids_bytes = sizeof(int32_t) * static_cast<size_t>(top_elements);
  const size_t top_bytes = sizeof(float) * static_cast<size_t>(top_elements);
  status = FirstError(
      {CheckBuffer(kTopOp, "logits", p.logits, logits_elements, sizeof(float),
                   absl::StrFormat("[num_logit_rows=%d, vocab_size=%d] fp32",
                                   p.num_logit_rows, p.vocab_size)),
       CheckBuffer(kTopOp, "rows", p.rows, p.num_rows, sizeof(int32_t),
                   absl::StrFormat("[num_rows=%d] int32", p.num_rows)),
       CheckBuffer(kTopOp, "logsumexp", p.logsumexp, p.num_rows, sizeof(float),
                   absl::StrFormat("[num_rows=%d] fp32", p.num_rows)),
       CheckBuffer(
           kTopOp, "top_token_ids", p.top_token_ids, top_elements,
           sizeof(int32_t),
           absl::StrFormat("[num_rows=%d, k=%d] int32", p.num_rows, p.k)),
       CheckBuffer(
           kTopOp, "top_logprobs", p.top_logprobs, top_elements, sizeof(float),
           absl::StrFormat("[num_rows=%d, k=%d] fp32", p.num_rows, p.k))});
  if (!status.ok()) return status;
  // The inputs are read while the outputs are written (in any order on
  // CUDA), and no output may clobber another.
  status = FirstError(
      {CheckDisjoint(kTopOp, "logsumexp", p.logsumexp, lse_bytes, "logits",
                     p.logits, logits_bytes),
       CheckDisjoint(kTopOp, "logsumexp", p.logsumexp, lse_bytes, "rows",
                     p.rows, row_bytes),
       CheckDisjoint(kTopOp, "top_token_ids", p.top_token_ids, ids_bytes,
                     "logits", p.logits, logits_bytes),
       CheckDisjoint(kTopOp, "top_token_ids", p.top_token_ids, ids_bytes,
                     "rows", p.rows, row_bytes),
       CheckDisjoint(kTopOp, "top_logprobs", p.top_logprobs, top_bytes,
                     "logits", p.logits, logits_bytes),
       CheckDisjoint(kTopOp, "top_logprobs", p.top_logprobs, top_bytes, "rows",
                     p.rows, row_bytes),
       CheckDisjoint(kTopOp, "logsumexp", p.logsumexp, lse_bytes,
                     "top_token_ids", p.top_token_ids, ids_bytes),
       CheckDisjoint(kTopOp, "logsumexp", p.logsumexp, lse_bytes,
                     "top_logprobs", p.top_logprobs, top_bytes),
       CheckDisjoint(kTopOp, "top_token_ids", p.top_token_ids, ids_bytes,
                     "top_logprobs", p.top_logprobs, top_bytes),
       CheckBackendImplemented(stream, kTopOp)});
  if (!status.ok()) return status;
  if (p.num_rows == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return TopLogprobsOnCuda(stream, p);
#endif
  return stream.Launch(kTopOp, [p](const OpContext&) { TopLogprobsCpu(p); });
}

absl::Status LaunchGatherLogprobs(Stream& stream,
                                  const GatherLogprobsParams& p) {
  PDW_RETURN_IF_ERROR(stream.RefuseDuringCapture(kGatherOp, kHostRows));
  absl::Status status = FirstError(
      {CheckNonNegative(kGatherOp, "num_rows", p.num_rows),
       CheckNonNegative(kGatherOp, "num_logit_rows", p.num_logit_rows),
       CheckPositive(kGatherOp, "vocab_size", p.vocab_size)});
  if (!status.ok()) return status;
  const int64_t logits_elements =
      static_cast<int64_t>(p.num_logit_rows) * p.vocab_size;
  const size_t out_bytes = sizeof(float) * static_cast<size_t>(p.num_rows);
  status = FirstError(
      {CheckBuffer(kGatherOp, "logits", p.logits, logits_elements,
                   sizeof(float),
                   absl::StrFormat("[num_logit_rows=%d, vocab_size=%d] fp32",
                                   p.num_logit_rows, p.vocab_size)),
       CheckBuffer(kGatherOp, "rows", p.rows, p.num_rows, sizeof(int32_t),
                   absl::StrFormat("[num_rows=%d] int32", p.num_rows)),
       CheckBuffer(
           kGatherOp, "token_ids", p.token_ids, p.num_logit_rows,
           sizeof(int32_t),
           absl::StrFormat("[num_logit_rows=%d] int32", p.num_logit_rows)),
       CheckBuffer(kGatherOp, "logsumexp", p.logsumexp, p.num_rows,
                   sizeof(float),
                   absl::StrFormat("[num_rows=%d] fp32", p.num_rows)),
       CheckBuffer(kGatherOp, "logprobs", p.logprobs, p.num_rows, sizeof(float),
                   absl::StrFormat("[num_rows=%d] fp32", p.num_rows)),
       // Everything the op reads must stay put while logprobs is written.
       CheckDisjoint(kGatherOp, "logprobs", p.logprobs, out_bytes, "logits",
                     p.logits,
                     sizeof(float) * static_cast<size_t>(logits_elements)),
       CheckDisjoint(kGatherOp, "logprobs", p.logprobs, out_bytes, "rows",
                     p.rows, sizeof(int32_t) * static_cast<size_t>(p.num_rows)),
       CheckDisjoint(kGatherOp, "logprobs", p.logprobs, out_bytes, "token_ids",
                     p.token_ids,
                     sizeof(int32_t) * static_cast<size_t>(p.num_logit_rows)),
       CheckDisjoint(kGatherOp, "logprobs", p.logprobs, out_bytes, "logsumexp",
                     p.logsumexp, out_bytes),
       CheckBackendImplemented(stream, kGatherOp)});
  if (!status.ok()) return status;
  if (p.num_rows == 0) return absl::OkStatus();
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) {
    return GatherLogprobsOnCuda(stream, p);
  }
#endif
  return stream.Launch(kGatherOp,
                       [p](const OpContext&) { GatherLogprobsCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
