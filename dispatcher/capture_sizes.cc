#include "dispatcher/capture_sizes.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

// Appends first, first+step, ... while <= min(last, cap).
void AppendRange(int first, int last, int step, int cap,
                 std::vector<int>* out) {
  const int end = std::min(last, cap);
  for (int v = first; v <= end; v += step) out->push_back(v);
}

// vLLM never captures more than 512 tokens by default: beyond that a mixed
// step is compute-bound and launch overhead no longer matters.
constexpr int kVllmDefaultCap = 512;

}  // namespace

std::vector<int> VllmCaptureSizesUpTo(int max_size) {
  std::vector<int> sizes;
  for (int v : {1, 2, 4}) {
    if (v <= max_size) sizes.push_back(v);
  }
  AppendRange(8, 248, 8, max_size, &sizes);
  AppendRange(256, max_size, 16, max_size, &sizes);
  return sizes;
}

int VllmDefaultMaxCaptureSize(int max_num_seqs, int uniform_decode_query_len,
                              int max_num_batched_tokens) {
  CHECK_GE(max_num_seqs, 1);
  CHECK_GE(uniform_decode_query_len, 1);
  CHECK_GE(max_num_batched_tokens, 1);
  // 64-bit so that absurd flag values cannot overflow before the clamp.
  const int64_t derived = std::min<int64_t>(
      2LL * max_num_seqs * uniform_decode_query_len, kVllmDefaultCap);
  return static_cast<int>(std::min<int64_t>(derived, max_num_batched_tokens));
}

std::vector<int> VllmDefaultCaptureSizes(int max_num_seqs,
                                         int uniform_decode_query_len,
                                         int max_num_batched_tokens) {
  return VllmCaptureSizesUpTo(VllmDefaultMaxCaptureSize(
      max_num_seqs, uniform_decode_query_len, max_num_batched_tokens));
}

std::vector<int> SglangDecodeBatchSizes(int max_bs,
                                        SglangDecodeSchedule schedule) {
  std::vector<int> sizes;
  switch (schedule) {
    case SglangDecodeSchedule::kNormal:
      for (int v : {1, 2, 4, 8, 12}) {
        if (v <= max_bs) sizes.push_back(v);
      }
      AppendRange(16, 256, 8, max_bs, &sizes);
      AppendRange(272, 511, 16, max_bs, &sizes);
      AppendRange(512, max_bs, 32, max_bs, &sizes);
      break;
    case SglangDecodeSchedule::kSpeculative:
      AppendRange(1, 8, 1, max_bs, &sizes);
      AppendRange(10, 32, 2, max_bs, &sizes);
      AppendRange(40, 64, 4, max_bs, &sizes);
      AppendRange(72, 256, 8, max_bs, &sizes);
      AppendRange(272, max_bs, 16, max_bs, &sizes);
      break;
  }
  return sizes;
}

std::vector<int> SglangPiecewiseTokenSizes(int max_tokens) {
  std::vector<int> sizes;
  AppendRange(4, 32, 4, max_tokens, &sizes);
  AppendRange(48, 256, 16, max_tokens, &sizes);
  AppendRange(288, 512, 32, max_tokens, &sizes);
  AppendRange(576, 1024, 64, max_tokens, &sizes);
  AppendRange(1280, 4096, 256, max_tokens, &sizes);
  AppendRange(4608, max_tokens, 512, max_tokens, &sizes);
  return sizes;
}

absl::Status ValidateCaptureSizes(const std::vector<int>& sizes,
                                  int max_num_batched_tokens,
                                  absl::string_view field_name) {
  if (sizes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_name,
                     " is empty: at least one capture size is needed "
                     "(use cudagraph_mode NONE to capture nothing)"));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_name, "[", i, "] = ", sizes[i],
                       " is not positive; capture sizes are token counts"));
    }
    if (i > 0 && sizes[i] <= sizes[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field_name, " must be sorted ascending without duplicates, but ",
          field_name, "[", i, "] = ", sizes[i], " follows ", sizes[i - 1]));
    }
    if (sizes[i] > max_num_batched_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          field_name, "[", i, "] = ", sizes[i],
          " exceeds max_num_batched_tokens = ", max_num_batched_tokens,
          "; a graph larger than the step budget can never be replayed"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> ResolveCaptureSizes(
    const CaptureSizeRequest& request, const ScheduleUpTo& schedule,
    int default_max, int max_num_batched_tokens) {
  if (max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_num_batched_tokens must be >= 1, got ", max_num_batched_tokens));
  }
  if (request.explicit_sizes.has_value()) {
    const std::vector<int>& sizes = *request.explicit_sizes;
    absl::Status status = ValidateCaptureSizes(sizes, max_num_batched_tokens,
                                               "cudagraph_capture_sizes");
    if (!status.ok()) return status;
    if (request.max_capture_size.has_value() &&
        *request.max_capture_size != sizes.back()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_cudagraph_capture_size = ", *request.max_capture_size,
          " is inconsistent with cudagraph_capture_sizes [",
          absl::StrJoin(sizes, ", "), "] whose largest entry is ", sizes.back(),
          "; give only one of them or make them agree"));
    }
    return sizes;
  }

  int max_size = std::min(default_max, max_num_batched_tokens);
  if (request.max_capture_size.has_value()) {
    max_size = *request.max_capture_size;
    if (max_size < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_cudagraph_capture_size must be >= 1, got ", max_size));
    }
    if (max_size > max_num_batched_tokens) {
      LOG(WARNING) << "max_cudagraph_capture_size = " << max_size
                   << " exceeds max_num_batched_tokens = "
                   << max_num_batched_tokens << "; truncating it to "
                   << max_num_batched_tokens;
      max_size = max_num_batched_tokens;
    }
  }
  std::vector<int> sizes = schedule(max_size);
  absl::Status status = ValidateCaptureSizes(sizes, max_num_batched_tokens,
                                             "default capture schedule");
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        status.message(), " (max_cudagraph_capture_size = ", max_size,
        ", max_num_batched_tokens = ", max_num_batched_tokens, ")"));
  }
  return sizes;
}

std::vector<int> UniformDecodeSizes(const std::vector<int>& capture_sizes,
                                    int query_len, int max_uniform_tokens) {
  CHECK_GE(query_len, 1);
  std::vector<int> out;
  for (int size : capture_sizes) {
    const int rounded = size / query_len * query_len;
    if (rounded <= 0 || rounded > max_uniform_tokens) continue;
    // Input is ascending, so rounded values are non-decreasing: checking the
    // last element is enough to deduplicate.
    if (!out.empty() && out.back() == rounded) continue;
    out.push_back(rounded);
  }
  return out;
}

}  // namespace pdworker
