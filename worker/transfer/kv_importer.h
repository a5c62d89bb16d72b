// KvImporter: the decode side of the KV handoff (Worker.ImportKv).
//
//   ImportKv ─▶ queue ─▶ importer thread:
//       1. reserve detached blocks        (the engine's queue: waits for
//          room like an admission, bounded by wait_timeout, the lease's
//          expiry when nobody renews it, and the client's deadline or
//          cancellation); a decode leg also takes a running seat there.
//          With prefix caching and the handle's prompt_token_ids, the
//          leading blocks this worker has cached are reused, not pulled
//       2. pull the rest of the KV        (this thread; steps go on)
//       3. attach them as the sequence    (engine task, between steps),
//          caching its full blocks
//       4. answer, then ReleaseKv on the source (the lease TTL is the
//          backstop if that call is lost)
//   From queueing until the import ends, a renewal thread calls RenewKv on
//   the source whenever the lease would expire within renew_margin, so an
//   import that waits behind others (or pulls slowly) keeps its source; an
//   abandoned lease (no importer renewing it) still expires at its TTL.
//   Any failure after 1 frees the reserved blocks (engine task), so a
//   failed import leaves nothing allocated.
//
// The pull runs on the importer's own threads, never the engine's, so a
// slow or dead prefill worker delays only the sequence being imported.
#ifndef PDWORKER_WORKER_TRANSFER_KV_IMPORTER_H_
#define PDWORKER_WORKER_TRANSFER_KV_IMPORTER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "metrics/worker_metrics.h"
#include "proto/worker.pb.h"
#include "worker/engine/engine.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/kv_span_staging.h"
#include "worker/transfer/nccl_comm_cache.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

struct KvImporterOptions {
  int num_threads = 4;    // concurrent pulls
  int max_pending = 256;  // queued imports; beyond: RESOURCE_EXHAUSTED
  std::chrono::milliseconds pull_timeout{10000};  // bound on one pull
  // How long an import may wait for KV room (blocks, and a running seat for
  // a decode leg) from its arrival, before RESOURCE_EXHAUSTED; 0 = fail at
  // once when there is no room.
  std::chrono::milliseconds wait_timeout{10000};
  // Renew the source's lease when it would expire within this while the
  // import is queued or running; 0 = never renew. Keep it below the
  // sources' TTL (30 s by default).
  std::chrono::milliseconds renew_margin{5000};
  // How pulls over the gRPC stream ask for chunks: token spans (one upload
  // and one scatter per chunk) or layer runs (block by block; what older
  // pullers get, kept for comparison).
  v1::KvChunkLayout stream_chunk_layout = v1::KV_CHUNK_LAYOUT_TOKEN_SPAN;
  // The token-span staging a pull starts with (grown to the source's chunk
  // size when larger); one per concurrent pull is kept.
  size_t span_staging_bytes = 256 << 10;
};

struct KvImportResult {
  int32_t num_tokens = 0;
  KvTransport transport = KvTransport::kGrpc;
  int64_t transfer_bytes = 0;  // of num_tokens - cached_tokens tokens
  int32_t cached_tokens = 0;   // leading tokens reused from our prefix cache
  double transfer_seconds = 0.0;
  double import_seconds = 0.0;
};

struct KvImportRequest {
  std::string sequence_id;  // validated: 1..128 bytes
  v1::KvHandle handle;      // validated: see ValidateKvHandle
  std::chrono::system_clock::time_point deadline =
      std::chrono::system_clock::time_point::max();
  // The client's cancellation, and `deadline` again (may be null): while the
  // import waits for room they withdraw it.
  std::shared_ptr<CallControl> control;
  ImportedAs imported_as = ImportedAs::kStepSequence;
};

class KvImporter {
 public:
  using Done = std::function<void(const absl::StatusOr<KvImportResult>&)>;

  // Everything must outlive the importer; `metrics` may be null;
  // `nccl_comms` (null: no NCCL pulls) keeps a communicator per source.
  KvImporter(Engine& engine, Device& device, KvCacheView view,
             std::string model_fingerprint, PeerChannels& peers,
             const KvImporterOptions& options, WorkerMetrics* metrics,
             NcclCommCache* nccl_comms);
  // Fails queued imports with UNAVAILABLE, lets running pulls finish (each
  // is bounded by pull_timeout) and joins.
  ~KvImporter();

  KvImporter(const KvImporter&) = delete;
  KvImporter& operator=(const KvImporter&) = delete;

  // Checks what needs no state (the handle matches this worker's model and
  // layout, the id is not being imported already), then queues. `done` is
  // called exactly once, inline when refused, else from an importer thread.
  void Import(KvImportRequest request, Done done);

  // Imports queued or running.
  int64_t in_flight() const;

 private:
  struct Job {
    KvImportRequest request;
    Done done;
    std::chrono::system_clock::time_point arrival;  // when Import queued it
  };

  void Work();
  absl::StatusOr<KvImportResult> RunJob(const Job& job);
  // Step 1 of RunJob: waits in the engine's queue until the blocks (and
  // seat) are reserved or the wait ends.
  absl::StatusOr<KvReservation> Reserve(const Job& job,
                                        absl::Span<const int32_t> token_ids);
  // Step 2 of RunJob: the best transport the handle allows (CUDA IPC on the
  // same host between CUDA workers, else NCCL when both have it; either
  // falls back to the gRPC stream when it could not start), recording
  // metrics.
  absl::Status Pull(const KvPullParams& params, KvTransport* used,
                    KvPullStats* stats);
  void ReleaseLease(const v1::KvHandle& handle);
  // The renewal thread: every renew_margin / 4 (at most 1 s) renews the
  // leases of queued and running imports that expire within renew_margin,
  // all calls of a round at once (each bounded by renew_margin / 2, at most
  // 2 s, so a silent source delays no other lease's renewal).
  void RenewLeases();

  // A lease an import still needs, and its expiry as last heard.
  struct RenewedLease {
    std::string source_address;
    std::string lease_id;
    std::chrono::system_clock::time_point expiry;
    bool gone = false;  // the source said it cannot renew: stop asking
    // Set when the source said the lease is gone (NOT_FOUND: expired or
    // released): an import still waiting for room stops waiting.
    std::shared_ptr<std::atomic<bool>> lost =
        std::make_shared<std::atomic<bool>>(false);
  };

  Engine& engine_;
  Device& device_;
  const KvCacheView view_;
  const std::string fingerprint_;
  PeerChannels& peers_;
  const KvImporterOptions options_;
  WorkerMetrics* const metrics_;
  const std::string host_id_;
  CudaIpcMappings ipc_mappings_;
  NcclCommCache* const nccl_comms_;  // null: no NCCL pulls
  // PullKvRequest.nccl_puller_id: random, new at every start.
  const std::string nccl_puller_id_;
  KvSpanStagingPool span_stagings_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> importing_ ABSL_GUARDED_BY(mu_);
  // By sequence id: the leases of queued and running imports.
  absl::flat_hash_map<std::string, RenewedLease> renewing_ ABSL_GUARDED_BY(mu_);
  std::condition_variable renew_cv_;  // wakes the renewal thread to stop
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  std::vector<std::thread> threads_;  // last: start after everything above
  std::thread renewer_;               // not started when renew_margin is 0
};

// INVALID_ARGUMENT for a handle missing what a pull needs (source address,
// lease id, num_tokens in [1, max_model_len]); FAILED_PRECONDITION for
// another model's or another KV layout's handle.
absl::Status ValidateKvHandle(const v1::KvHandle& handle,
                              const std::string& model_fingerprint,
                              const KvLayoutInfo& layout, int max_model_len);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_KV_IMPORTER_H_
