// The graph-recording interface GraphWrapper needs, with no device code.
//
// worker/runtime implements it for CUDA (stream capture into a cudaGraphExec)
// and for the CPU (op closures recorded with frozen arguments). Keeping the
// interface here lets dispatcher/ stay free of device headers.
#ifndef PDWORKER_DISPATCHER_GRAPH_BACKEND_H_
#define PDWORKER_DISPATCHER_GRAPH_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdworker {

// A recorded sequence of device work that can be launched again. Replay
// reads and writes exactly the buffers that were used while recording: new
// inputs must be written into those same (static) buffers beforehand, and any
// value the host computed while recording is baked in.
class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;

  // Launches the recorded work on the stream it was captured on. Asynchronous
  // on a GPU; on the CPU backend the work is done when this returns.
  virtual absl::Status Replay() = 0;

  // The recorded work items: CUDA graph nodes (kernels, copies, memsets),
  // or the CPU backend's recorded ops. A FULL decode graph's count is the
  // step's kernels-per-step figure (issue 23).
  virtual size_t num_nodes() const = 0;
};

// Something that can record the work issued between BeginCapture and
// EndCapture into a CapturedGraph (in worker/runtime: a Stream). Work issued
// while capturing is recorded, not executed.
class GraphBackend {
 public:
  virtual ~GraphBackend() = default;

  // Starts recording. Fails if a capture is already in progress.
  virtual absl::Status BeginCapture() = 0;

  // Stops recording and returns the executable graph. Always leaves the
  // backend out of capture mode, even when it fails (e.g. because a forbidden
  // operation such as an allocation or a synchronize invalidated the capture).
  virtual absl::StatusOr<std::unique_ptr<CapturedGraph>> EndCapture() = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_GRAPH_BACKEND_H_
