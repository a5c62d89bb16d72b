// StepInfo: what one model step did, the one struct that carries it from the
// model runner through the engine to metrics and the wire
// (ForwardResponse.step).
#ifndef PDWORKER_DISPATCHER_STEP_INFO_H_
#define PDWORKER_DISPATCHER_STEP_INFO_H_

#include "dispatcher/batch_descriptor.h"
#include "dispatcher/cudagraph_dispatcher.h"

namespace pdworker {

struct StepInfo {
  RuntimeMode mode = RuntimeMode::kNone;
  // Why the step ran eagerly (kNone when a graph ran).
  FallbackReason fallback_reason = FallbackReason::kNone;
  BatchDescriptor descriptor;  // the key that ran (padded unless NONE)
  int unpadded_tokens = 0;
  int padded_tokens = 0;
  int num_sequences = 0;  // everything merged into the step
  // Set by the engine: step-level calls and engine-owned requests in it.
  int num_calls = 0;
  int num_requests = 0;
  // Stream time from the step's first operation (its input upload) to its
  // last (the sampled tokens' copy to the host), in seconds.
  double device_seconds = 0.0;
  // Stream time the device sat idle between the previous step's last
  // operation and this step's first: what host/device overlap removes.
  double idle_before_seconds = 0.0;
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_STEP_INFO_H_
