// What one forward step runs with, handed explicitly to every GraphWrapper.
#ifndef PDWORKER_DISPATCHER_FORWARD_CONTEXT_H_
#define PDWORKER_DISPATCHER_FORWARD_CONTEXT_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "dispatcher/batch_descriptor.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

// The dispatcher's decision for one step: which runtime mode to run and which
// (padded) batch shape is the graph key. vLLM keeps this in a global forward
// context; we pass it down the call chain so nested wrappers see the same
// decision without hidden state.
struct ForwardContext {
  RuntimeMode runtime_mode = RuntimeMode::kNone;
  BatchDescriptor batch_descriptor;

  // e.g. "ForwardContext(FULL, BatchDescriptor(num_tokens=8, ...))".
  std::string ToString() const {
    return absl::StrCat("ForwardContext(", RuntimeModeName(runtime_mode), ", ",
                        batch_descriptor.ToString(), ")");
  }
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_FORWARD_CONTEXT_H_
