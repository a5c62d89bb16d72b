#include "worker/runtime/cpu_graph.h"

#include "worker/runtime/cpu_stream.h"

namespace pdworker {

absl::Status CpuGraph::Replay() {
  absl::Status allowed = stream_.CheckReplayAllowed();
  if (!allowed.ok()) return allowed;
  return stream_.EnqueueReplay(ops_);
}

}  // namespace pdworker
