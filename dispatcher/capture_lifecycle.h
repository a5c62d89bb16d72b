// CaptureLifecycle: where the startup graph capture stands, in one place.
#ifndef PDWORKER_DISPATCHER_CAPTURE_LIFECYCLE_H_
#define PDWORKER_DISPATCHER_CAPTURE_LIFECYCLE_H_

#include <atomic>
#include <cstdint>
#include <ostream>

#include "absl/strings/string_view.h"

namespace pdworker {

// The stages of the graphs' life. The dispatcher maps them to its fallback
// reasons; the wrappers capture an unseen key only in kCapturing.
enum class CaptureStage : uint8_t {
  // Nothing captured yet (or a capture session ended without being marked
  // ready): steps run eagerly, reason still_capturing.
  kNotCaptured,
  // The capture session runs: wrappers may capture unseen keys; real steps
  // still run eagerly (still_capturing), since not every key has a graph.
  kCapturing,
  // Every key the dispatcher hands out has a captured graph.
  kReady,
  // Capture failed or graphs were turned off: eager, capture_disabled.
  kDisabled,
};

// Stable snake_case name, e.g. "not_captured".
absl::string_view CaptureStageName(CaptureStage stage);
std::ostream& operator<<(std::ostream& os, CaptureStage stage);

// Owned by the model runner, read by its dispatcher (which graphs may be
// replayed) and its wrappers (whether an unseen key may be captured). One
// object, so the two can never disagree about whether capture is running.
//
// Capture is only legal in kCapturing: a graph captured on the step path
// would stall that step (capture + instantiate take milliseconds) and would
// mean the dispatcher handed out a key it never captured. vLLM guards this
// with a global flag (validate_cudagraph_capturing_enabled); we make it an
// object passed explicitly.
//
// Not whether a stream is recording right now: that is the stream's own fact
// (Stream::IsCapturing), true only inside one wrapper's capture, within the
// window.
//
// Thread-safe: the stage is an atomic, so the engine thread may dispatch
// while another thread changes the stage. Release/acquire so that a reader
// that sees kReady also sees the graphs captured before it was set.
class CaptureLifecycle {
 public:
  // Moves to kCapturing for the lifetime of the window (RAII) and back to
  // kNotCaptured when it closes, unless the stage was changed meanwhile
  // (MarkReady or Disable win). Whether the captured graphs are ready is the
  // owner's call after the window, once it has checked the session's result.
  class CaptureWindow {
   public:
    explicit CaptureWindow(CaptureLifecycle& lifecycle)
        : lifecycle_(lifecycle) {
      lifecycle_.stage_.store(CaptureStage::kCapturing,
                              std::memory_order_release);
    }
    ~CaptureWindow() {
      CaptureStage capturing = CaptureStage::kCapturing;
      lifecycle_.stage_.compare_exchange_strong(
          capturing, CaptureStage::kNotCaptured, std::memory_order_acq_rel);
    }
    CaptureWindow(const CaptureWindow&) = delete;
    CaptureWindow& operator=(const CaptureWindow&) = delete;

   private:
    CaptureLifecycle& lifecycle_;
  };

  CaptureLifecycle() = default;
  CaptureLifecycle(const CaptureLifecycle&) = delete;
  CaptureLifecycle& operator=(const CaptureLifecycle&) = delete;

  CaptureStage stage() const { return stage_.load(std::memory_order_acquire); }
  // Whether a wrapper may capture an unseen key now: the capture window is
  // open.
  bool CaptureAllowed() const { return stage() == CaptureStage::kCapturing; }

  // The capture session succeeded: the dispatcher's keys may be replayed.
  void MarkReady() {
    stage_.store(CaptureStage::kReady, std::memory_order_release);
  }
  // Capture failed or graphs are turned off: every step runs eagerly.
  void Disable() {
    stage_.store(CaptureStage::kDisabled, std::memory_order_release);
  }

 private:
  std::atomic<CaptureStage> stage_{CaptureStage::kNotCaptured};
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CAPTURE_LIFECYCLE_H_
