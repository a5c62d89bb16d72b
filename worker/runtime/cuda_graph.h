// CudaGraph: an instantiated, uploaded cudaGraphExec_t.
#ifndef PDWORKER_WORKER_RUNTIME_CUDA_GRAPH_H_
#define PDWORKER_WORKER_RUNTIME_CUDA_GRAPH_H_

#include <cstddef>

#include "absl/status/status.h"
#include "dispatcher/graph_backend.h"
#include "worker/runtime/cuda_handles.h"

namespace pdworker {

class CudaStream;

class CudaGraph final : public CapturedGraph {
 public:
  // `stream` (the capture stream, where replays launch) must outlive Replay
  // calls; destroying the graph does not need it.
  CudaGraph(CudaStream& stream, UniqueCudaGraphExec exec, size_t num_nodes)
      : stream_(stream), exec_(std::move(exec)), num_nodes_(num_nodes) {}

  // cudaGraphLaunch on the capture stream; asynchronous.
  absl::Status Replay() override;

  // Nodes (kernels, memcpys, ...) the capture recorded.
  size_t num_nodes() const override { return num_nodes_; }

 private:
  CudaStream& stream_;
  UniqueCudaGraphExec exec_;
  size_t num_nodes_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CUDA_GRAPH_H_
