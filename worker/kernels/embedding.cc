#include "worker/kernels/embedding.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/kernels/kernel_checks.h"

#if PDW_HAVE_CUDA
#include "worker/kernels/embedding_cuda.h"
#include "worker/runtime/cuda_status.h"
#endif

namespace pdworker {
namespace kernels {
namespace {

constexpr char kOp[] = "embedding";

void EmbeddingCpu(const EmbeddingParams& p) {
  const int32_t* ids = p.token_ids.as<const int32_t>();
  const float* table = p.table.as<const float>();
  float* out = p.output.as<float>();
  const size_t row_bytes = sizeof(float) * p.hidden_size;
  for (int t = 0; t < p.num_tokens; ++t) {
    const int32_t id = ids[t];
    float* dst = out + static_cast<int64_t>(t) * p.hidden_size;
    if (id < 0 || id >= p.vocab_size) {
      std::memset(dst, 0, row_bytes);
      continue;
    }
    const float* row = table + static_cast<int64_t>(id) * p.hidden_size;
    if (p.scale == 1.0f) {
      std::memcpy(dst, row, row_bytes);
    } else {
      for (int i = 0; i < p.hidden_size; ++i) dst[i] = row[i] * p.scale;
    }
  }
}

#if PDW_HAVE_CUDA
absl::Status EmbeddingOnCuda(Stream& stream, const EmbeddingParams& p) {
  EmbeddingCudaParams c;
  c.token_ids = p.token_ids.as<const int32_t>();
  c.table = p.table.as<const __nv_bfloat16>();
  c.output = p.output.as<__nv_bfloat16>();
  c.num_tokens = p.num_tokens;
  c.vocab_size = p.vocab_size;
  c.hidden_size = p.hidden_size;
  c.scale = p.scale;
  return LaunchCudaOp(stream, kOp, [c](const OpContext& ctx) {
    return CudaStatus(
        LaunchEmbeddingCuda(c, static_cast<cudaStream_t>(ctx.cuda_stream)),
        kOp);
  });
}
#endif

}  // namespace

absl::Status LaunchEmbedding(Stream& stream, const EmbeddingParams& p) {
  absl::Status status =
      FirstError({CheckPositive(kOp, "num_tokens", p.num_tokens),
                  CheckPositive(kOp, "vocab_size", p.vocab_size),
                  CheckPositive(kOp, "hidden_size", p.hidden_size)});
  if (!status.ok()) return status;
  const int64_t rows = p.num_tokens;
  const size_t element = DTypeSize(p.dtype);
  const absl::string_view type = ShortDTypeName(p.dtype);
  status = FirstError(
      {CheckModelDType(stream, kOp, "dtype", p.dtype),
       CheckBuffer(kOp, "token_ids", p.token_ids, rows, sizeof(int32_t),
                   absl::StrFormat("[num_tokens=%d] int32", rows)),
       CheckBuffer(kOp, "table", p.table,
                   static_cast<int64_t>(p.vocab_size) * p.hidden_size, element,
                   absl::StrFormat("[vocab_size=%d, hidden_size=%d] %s",
                                   p.vocab_size, p.hidden_size, type)),
       CheckBuffer(kOp, "output", p.output, rows * p.hidden_size, element,
                   absl::StrFormat("[num_tokens=%d, hidden_size=%d] %s", rows,
                                   p.hidden_size, type)),
       CheckBackendImplemented(stream, kOp)});
  if (!status.ok()) return status;
  if (!std::isfinite(p.scale)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: scale must be finite, got %g", kOp, p.scale));
  }
#if PDW_HAVE_CUDA
  if (stream.kind() == DeviceKind::kCuda) return EmbeddingOnCuda(stream, p);
#endif
  return stream.Launch(kOp, [p](const OpContext&) { EmbeddingCpu(p); });
}

}  // namespace kernels
}  // namespace pdworker
