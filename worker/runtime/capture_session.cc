#include "worker/runtime/capture_session.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

absl::Status WithKey(const absl::Status& status, absl::string_view stage,
                     RuntimeMode mode, const BatchDescriptor& key) {
  return absl::Status(
      status.code(),
      absl::StrCat("capture session, ", stage, " for ", RuntimeModeName(mode),
                   " ", key.ToString(), ": ", status.message()));
}

absl::Status ValidateParams(const CaptureSessionParams& params) {
  if (params.device == nullptr || params.stream == nullptr ||
      params.capture_lifecycle == nullptr) {
    return absl::InvalidArgumentError(
        "capture session needs a device, a stream and a capture lifecycle");
  }
  if (!params.prepare_inputs || !params.forward) {
    return absl::InvalidArgumentError(
        "capture session needs prepare_inputs and forward");
  }
  if (params.num_warmups < 0) {
    return absl::InvalidArgumentError("num_warmups must be >= 0");
  }
  for (const auto& [mode, keys] : params.descs) {
    if (mode == RuntimeMode::kNone && !keys.empty()) {
      return absl::InvalidArgumentError(
          "capture descriptors list keys for runtime mode NONE");
    }
  }
  return absl::OkStatus();
}

// Work queued before or during the mode must be finished before reading
// memory or the clock.
absl::StatusOr<size_t> SettledUsedBytes(const CaptureSessionParams& params) {
  absl::Status synced = params.stream->Synchronize();
  if (!synced.ok()) return synced;
  absl::StatusOr<MemoryStats> stats = params.device->GetMemoryStats();
  if (!stats.ok()) return stats.status();
  return stats->used_bytes;
}

absl::StatusOr<ModeCaptureSummary> CaptureMode(
    const CaptureSessionParams& params, RuntimeMode mode,
    std::vector<BatchDescriptor> keys) {
  std::sort(keys.begin(), keys.end(),
            [](const BatchDescriptor& a, const BatchDescriptor& b) {
              return b < a;  // Largest first.
            });
  ModeCaptureSummary summary;
  summary.mode = mode;
  absl::StatusOr<size_t> used_before = SettledUsedBytes(params);
  if (!used_before.ok()) return used_before.status();
  const auto start = std::chrono::steady_clock::now();

  for (const BatchDescriptor& key : keys) {
    absl::Status status = params.prepare_inputs(key);
    if (!status.ok()) return WithKey(status, "preparing inputs", mode, key);
    for (int i = 0; i < params.num_warmups; ++i) {
      status = params.forward(ForwardContext{RuntimeMode::kNone, key});
      if (!status.ok()) return WithKey(status, "warm-up", mode, key);
      ++summary.num_warmup_runs;
    }
    status = params.forward(ForwardContext{mode, key});
    if (!status.ok()) return WithKey(status, "capture", mode, key);
    ++summary.num_graphs;
  }

  absl::StatusOr<size_t> used_after = SettledUsedBytes(params);
  if (!used_after.ok()) return used_after.status();
  summary.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  summary.memory_delta_bytes =
      static_cast<int64_t>(*used_after) - static_cast<int64_t>(*used_before);
  return summary;
}

}  // namespace

absl::StatusOr<CaptureSummary> RunCaptureSession(
    const CaptureSessionParams& params) {
  absl::Status valid = ValidateParams(params);
  if (!valid.ok()) return valid;

  CaptureSummary summary;
  CaptureLifecycle::CaptureWindow capturing(*params.capture_lifecycle);
  for (const auto& [mode, keys] : params.descs) {
    if (keys.empty()) continue;
    absl::StatusOr<ModeCaptureSummary> mode_summary =
        CaptureMode(params, mode, keys);
    if (!mode_summary.ok()) return mode_summary.status();
    LOG(INFO) << "Captured " << mode_summary->num_graphs << " "
              << RuntimeModeName(mode) << " graphs on " << params.device->name()
              << " (" << mode_summary->num_warmup_runs << " warm-up runs) in "
              << mode_summary->seconds << " s, device memory delta "
              << mode_summary->memory_delta_bytes << " bytes";
    summary.total_seconds += mode_summary->seconds;
    summary.total_memory_delta_bytes += mode_summary->memory_delta_bytes;
    summary.total_graphs += mode_summary->num_graphs;
    summary.modes.push_back(*mode_summary);
  }
  return summary;
}

}  // namespace pdworker
