// CaptureSession: the startup loop that warms up and captures every graph the
// dispatcher will hand out, and reports what it cost.
#ifndef PDWORKER_WORKER_RUNTIME_CAPTURE_SESSION_H_
#define PDWORKER_WORKER_RUNTIME_CAPTURE_SESSION_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dispatcher/batch_descriptor.h"
#include "dispatcher/capture_lifecycle.h"
#include "dispatcher/capture_summary.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/forward_context.h"
#include "worker/runtime/device.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// What to capture: for each runtime mode (FULL, PIECEWISE) its keys, as
// returned by CudagraphDispatcher::GetCaptureDescs().
using CaptureDescs =
    std::vector<std::pair<RuntimeMode, std::vector<BatchDescriptor>>>;

struct CaptureSessionParams {
  Device* device = nullptr;
  // The worker's stream (the one the wrappers capture on).
  Stream* stream = nullptr;
  // kCapturing for the duration of the session (a CaptureWindow), then
  // kNotCaptured: whether the graphs are ready, or capture is disabled, is
  // the owner's call once it has checked the result.
  CaptureLifecycle* capture_lifecycle = nullptr;
  CaptureDescs descs;
  // Eager (NONE) runs before each capture: first-run work such as lazy
  // kernel-module loading or cuBLAS heuristics must not land in a graph.
  int num_warmups = 1;
  // Writes dummy inputs for `descriptor` into the static buffers (token ids,
  // positions, slot mapping, ...).
  std::function<absl::Status(const BatchDescriptor&)> prepare_inputs;
  // Runs the (wrapped) model under `context`; the wrappers capture.
  std::function<absl::Status(const ForwardContext&)> forward;
};

// For each mode in order, and within it the keys largest first (by
// num_tokens, then num_reqs; the largest graph sets the high-water mark the
// smaller ones reuse): prepare inputs, run `num_warmups` times in NONE mode,
// then run once in the mode so the wrappers capture. Logs one line per mode.
// Stops at the first error, which names the mode and key.
absl::StatusOr<CaptureSummary> RunCaptureSession(
    const CaptureSessionParams& params);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CAPTURE_SESSION_H_
