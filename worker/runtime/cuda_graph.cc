#include "worker/runtime/cuda_graph.h"

#include "worker/runtime/cuda_status.h"
#include "worker/runtime/cuda_stream.h"

namespace pdworker {

absl::Status CudaGraph::Replay() {
  absl::Status allowed = stream_.CheckReplayAllowed();
  if (!allowed.ok()) return allowed;
  return CudaStatus(cudaGraphLaunch(exec_.get(), stream_.native()),
                    "cudaGraphLaunch");
}

}  // namespace pdworker
