#include "worker/runtime/cpu_graph.h"

namespace pdworker {

absl::Status CpuGraph::Replay() {
  absl::Status allowed = stream_.CheckReplayAllowed();
  if (!allowed.ok()) return allowed;
  const OpContext context;  // CPU ops need no native handles.
  for (const RecordedOp& recorded : ops_) recorded.op(context);
  return absl::OkStatus();
}

}  // namespace pdworker
