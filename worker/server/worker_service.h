// WorkerService: the pdworker.v1.Worker RPC handlers on gRPC's callback API.
// Handlers never block: Forward and Release are validated on the gRPC
// thread, queued on the Engine and finished from the engine thread;
// GetStatus and GetGraphStats answer from published snapshots.
#ifndef PDWORKER_WORKER_SERVER_WORKER_SERVICE_H_
#define PDWORKER_WORKER_SERVER_WORKER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "dispatcher/graph_stats.h"
#include "metrics/worker_metrics.h"
#include "proto/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runner/model_runner.h"
#include "worker/server/request_validation.h"
#include "worker/transfer/kv_importer.h"

namespace pdworker {

// The worker's lifecycle as RPCs see it.
enum class ServingState {
  kStarting,  // capturing graphs: Forward/Release -> UNAVAILABLE
  kServing,
  // Shutting down: live sequences may still step and be released; new
  // sequences (start, ImportKv) -> UNAVAILABLE.
  kDraining,
};

// What an RPC may do while the worker drains.
enum class WhileDraining {
  kRefuse,              // it would start new work (ImportKv)
  kLetTheEngineDecide,  // Forward and Release: steps of live sequences run
};

// The KV handoff's parts, owned by the WorkerServer.
struct HandoffParts {
  KvLeaseTable* leases = nullptr;  // prefill side
  KvImporter* importer = nullptr;  // decode side
  std::string advertise_address;   // KvHandle.source_address
  bool offers_cuda_ipc = false;    // KvHandle.transports lists cuda_ipc
  bool offers_nccl = false;        // ... and nccl
  std::string source_epoch;        // KvHandle.source_epoch
};

// Every method raw: requests are parsed by us (parsed_call.h says why).
using RawWorkerService = v1::Worker::WithRawCallbackMethod_Forward<
    v1::Worker::WithRawCallbackMethod_Release<
        v1::Worker::WithRawCallbackMethod_GetStatus<
            v1::Worker::WithRawCallbackMethod_GetGraphStats<
                v1::Worker::WithRawCallbackMethod_ImportKv<
                    v1::Worker::WithRawCallbackMethod_FlushCache<
                        v1::Worker::Service>>>>>>;

class WorkerService final : public RawWorkerService {
 public:
  // Reads the runner's static configuration now (before serving); from then
  // on only `engine` touches the runner. `metrics` may be null.
  WorkerService(const ModelRunner& runner, Engine& engine,
                WorkerMetrics* metrics, const std::string& device_name,
                const HandoffParts& handoff);

  void SetState(ServingState state);
  // KvHandle.source_address; set before serving (the Forward reactors read
  // it without a lock once the state is kServing).
  void SetAdvertiseAddress(const std::string& address);
  ServingState state() const { return state_.load(std::memory_order_acquire); }
  // What every KvHandle this worker issues carries besides the lease; final
  // once serving (SetAdvertiseAddress comes before).
  const v1::KvHandle& handle_template() const { return handle_template_; }
  // Reported by GetStatus once capture is done.
  void SetGraphsCaptured(int graphs);

  // Requests and responses are ForwardRequest/ForwardResponse and so on, as
  // proto/worker.proto says, serialized.
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetGraphStats(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ImportKv(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* FlushCache(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

 private:
  // OK while serving (and while draining, for kLetTheEngineDecide);
  // UNAVAILABLE naming why otherwise.
  absl::Status CheckServing(WhileDraining while_draining) const;
  // GetStatus's answer.
  void FillStatus(v1::WorkerStatus* response) const;
  void FillGraphStats(v1::GraphStatsResponse* response) const;

  Engine& engine_;
  WorkerMetrics* const metrics_;
  const GraphStats& graph_stats_;  // thread-safe
  const GraphStatsHeader table_header_;
  const RequestLimits limits_;
  HandoffParts handoff_;
  // What every KvHandle this worker issues carries besides the lease.
  v1::KvHandle handle_template_;
  const std::string fingerprint_;
  const KvLayoutInfo kv_layout_;
  // What the handoff RPCs accept: decode holds no prompt, prefill imports no
  // KV (README, "Roles").
  const Role role_;
  const bool prefix_caching_;
  std::atomic<ServingState> state_{ServingState::kStarting};

  mutable std::mutex mu_;
  // The static part of GetStatus, filled at construction.
  v1::WorkerStatus status_template_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_WORKER_SERVICE_H_
