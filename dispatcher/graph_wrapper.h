// GraphWrapper: a runnable with captured-graph abilities, bound to one
// runtime mode (vLLM v1's CUDAGraphWrapper, in C++).
#ifndef PDWORKER_DISPATCHER_GRAPH_WRAPPER_H_
#define PDWORKER_DISPATCHER_GRAPH_WRAPPER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dispatcher/batch_descriptor.h"
#include "dispatcher/capture_lifecycle.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/forward_context.h"
#include "dispatcher/graph_backend.h"

namespace pdworker {

// When an unseen key may be captured.
enum class CapturePolicy {
  // Only while the CaptureLifecycle is kCapturing (the startup capture
  // session); an unseen key on the step path is an error, because the
  // dispatcher must only hand out keys that were captured.
  kCapturePhaseOnly,
  // Capture whenever an unseen key arrives (tests, experiments).
  kLazy,
};

// Debug check of the static-buffer contract: record the input buffer
// addresses at capture and compare them at every replay.
enum class InputAddressCheck { kOff, kOn };

struct GraphWrapperOptions {
  // Shown in errors and logs, e.g. "full_forward" or "piece_3".
  std::string name = "graph_wrapper";
  CapturePolicy capture_policy = CapturePolicy::kCapturePhaseOnly;
  InputAddressCheck input_address_check = InputAddressCheck::kOff;
};

// How each call was served.
struct GraphWrapperCounters {
  int64_t captures = 0;
  int64_t replays = 0;
  // Calls that ran the runnable directly: mode NONE or another mode's turn.
  int64_t passthroughs = 0;
};

// Wraps a runnable (the whole forward for FULL, one piece between attention
// layers for PIECEWISE) and, for each call, trusts the ForwardContext:
//   - runtime mode NONE, or a mode other than this wrapper's -> run directly;
//   - this wrapper's mode and an unseen batch descriptor     -> capture, cache;
//   - this wrapper's mode and a seen batch descriptor        -> replay.
// A FULL wrapper around the forward and PIECEWISE wrappers around its pieces
// therefore coexist: in FULL mode only the outer one fires (the inner ones run
// directly and are recorded into the outer graph), in PIECEWISE mode only the
// inner ones, in NONE neither.
//
// The runnable must write its outputs into static buffers (captured graphs
// have no outputs of their own). Not thread-safe: one engine thread calls
// Run. The backend and capture lifecycle must outlive the wrapper.
class GraphWrapper {
 public:
  using Runnable = std::function<absl::Status(const ForwardContext&)>;

  struct Params {
    Runnable runnable;
    // kFull or kPiecewise.
    RuntimeMode mode = RuntimeMode::kFull;
    // Records the graphs (a worker/runtime Stream). Not owned.
    GraphBackend* backend = nullptr;
    // Tells whether capture is allowed now (kCapturing). Not owned.
    const CaptureLifecycle* capture_lifecycle = nullptr;
    GraphWrapperOptions options;
  };

  explicit GraphWrapper(Params params);
  GraphWrapper(const GraphWrapper&) = delete;
  GraphWrapper& operator=(const GraphWrapper&) = delete;

  // Runs, captures or replays for `context`. `input_addresses` are the
  // addresses of the buffers the runnable reads; they are only used by the
  // InputAddressCheck debug option.
  //
  // A capture records the runnable's work and then replays the new graph once,
  // so the call's outputs are valid (CUDA stream capture records work without
  // executing it). If capture fails nothing is cached and the next call with
  // the same key tries again.
  absl::Status Run(const ForwardContext& context,
                   absl::Span<const void* const> input_addresses = {});

  RuntimeMode mode() const { return mode_; }
  const std::string& name() const { return options_.name; }
  const GraphWrapperCounters& counters() const { return counters_; }
  // Number of captured graphs (one per batch descriptor).
  size_t num_graphs() const { return entries_.size(); }
  bool HasGraph(const BatchDescriptor& key) const {
    return entries_.contains(key);
  }
  // The captured graph's node count for `key` (CapturedGraph::num_nodes);
  // 0 when none is cached.
  size_t NumNodes(const BatchDescriptor& key) const;
  // Replays the cached graph of `key` as it is, on whatever the static input
  // buffers hold (benchmarks: the forward alone, with the inputs the last
  // step left). No counters move. NOT_FOUND when none is cached.
  absl::Status Replay(const BatchDescriptor& key) const;

 private:
  struct Entry {
    std::unique_ptr<CapturedGraph> graph;
    // Only filled with InputAddressCheck::kOn.
    std::vector<const void*> input_addresses;
  };

  absl::Status Capture(const ForwardContext& context,
                       absl::Span<const void* const> input_addresses);
  absl::Status CheckInputAddresses(const ForwardContext& context,
                                   const Entry& entry,
                                   absl::Span<const void* const> actual) const;
  // Prefixes `status` with the wrapper's name, mode and key.
  absl::Status Annotate(const absl::Status& status,
                        const ForwardContext& context) const;

  Runnable runnable_;
  RuntimeMode mode_;
  GraphBackend* backend_;
  const CaptureLifecycle* capture_lifecycle_;
  GraphWrapperOptions options_;
  absl::flat_hash_map<BatchDescriptor, Entry> entries_;
  GraphWrapperCounters counters_;
};

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_GRAPH_WRAPPER_H_
