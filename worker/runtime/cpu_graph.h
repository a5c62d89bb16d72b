// CpuGraph: a captured list of op closures, replayed in order.
#ifndef PDWORKER_WORKER_RUNTIME_CPU_GRAPH_H_
#define PDWORKER_WORKER_RUNTIME_CPU_GRAPH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "dispatcher/graph_backend.h"
#include "worker/runtime/stream.h"

namespace pdworker {

class CpuStream;

// One recorded launch: its closure holds the arguments (pointers, sizes,
// scalars) as they were at capture time.
struct RecordedOp {
  std::string name;
  Op op;
};

// The CPU backend's graph. Honest to the CUDA contract: replay runs exactly
// the recorded closures, so it sees new *contents* of the static buffers but
// never new pointers or new host-side values. Replay enqueues the whole list
// as one task on the capture stream (the worker thread runs it with
// CpuStreamExecution::kThreaded), like cudaGraphLaunch.
class CpuGraph final : public CapturedGraph {
 public:
  // `stream` must outlive Replay calls; a replay still queued keeps the ops
  // alive, so the graph itself may be destroyed right after Replay.
  CpuGraph(CpuStream& stream, std::vector<RecordedOp> ops)
      : stream_(stream),
        ops_(std::make_shared<const std::vector<RecordedOp>>(std::move(ops))) {}

  absl::Status Replay() override;

  size_t num_ops() const { return ops_->size(); }
  size_t num_nodes() const override { return ops_->size(); }
  const std::vector<RecordedOp>& ops() const { return *ops_; }

 private:
  CpuStream& stream_;
  std::shared_ptr<const std::vector<RecordedOp>> ops_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_CPU_GRAPH_H_
