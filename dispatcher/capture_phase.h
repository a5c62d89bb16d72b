// Whether graphs may be captured right now.
#ifndef PDWORKER_DISPATCHER_CAPTURE_PHASE_H_
#define PDWORKER_DISPATCHER_CAPTURE_PHASE_H_

#include <atomic>

namespace pdworker {

// Capture is only legal during the startup capture phase: a graph captured on
// the step path would stall that step (capture + instantiate take
// milliseconds) and would mean the dispatcher handed out a key it never
// captured. vLLM guards this with a global flag
// (validate_cudagraph_capturing_enabled); we make it an object the model
// runner owns and hands to its wrappers.
class CapturePhase {
 public:
  // Opens the phase for the lifetime of the scope (RAII).
  class Scope {
   public:
    explicit Scope(CapturePhase& phase) : phase_(phase) { phase_.Open(); }
    ~Scope() { phase_.Close(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CapturePhase& phase_;
  };

  CapturePhase() = default;
  CapturePhase(const CapturePhase&) = delete;
  CapturePhase& operator=(const CapturePhase&) = delete;

  void Open() { open_.store(true, std::memory_order_release); }
  void Close() { open_.store(false, std::memory_order_release); }
  bool IsOpen() const { return open_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> open_{false};
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_CAPTURE_PHASE_H_
