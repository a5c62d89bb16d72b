// KvTransferService: the source side of the KV handoff (pdworker.v1.
// KvTransfer). PullKv streams a held lease's K/V from the request's
// first_token on, in token spans of every layer (KvSpanStaging) or, for
// older pullers, layer by layer in chunks of whole source blocks, with one
// chunk in flight (gRPC flow control paces it to the puller); ReleaseKv
// frees a lease.
//
// Pulls read the lease's blocks on gRPC threads through their own stream:
// leased blocks belong to no sequence, so no model step touches them.
// Pulls keep being served while the worker drains, so a rolling restart of
// prefill workers does not strand prompts already prefilled.
#ifndef PDWORKER_WORKER_TRANSFER_KV_TRANSFER_SERVICE_H_
#define PDWORKER_WORKER_TRANSFER_KV_TRANSFER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>
#include <string>

#include "metrics/worker_metrics.h"
#include "proto/worker.grpc.pb.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device.h"
#include "worker/transfer/kv_span_staging.h"
#include "worker/transfer/nccl_comm_cache.h"

namespace pdworker {

struct KvTransferServiceOptions {
  // Upper bound on one KvChunk's payload. Token spans hold as many tokens
  // as fit (at least one); layer runs whole source blocks (at least one).
  // Either may exceed it when one token (one block) is larger.
  size_t max_chunk_bytes = 256 << 10;
  // Token-span stagings (device + pinned host buffers of one chunk each,
  // 512 KiB at the default chunk size) kept between pulls; concurrent
  // pulls beyond it allocate their own and free them after, and freeing
  // device memory waits for the whole device (the model's steps too).
  int max_idle_span_stagings = 16;
};

class NcclSender;

// Every method raw: requests are parsed by us (worker/rpc/parsed_call.h
// says why).
using RawKvTransferService = v1::KvTransfer::WithRawCallbackMethod_PullKv<
    v1::KvTransfer::WithRawCallbackMethod_ReleaseKv<
        v1::KvTransfer::WithRawCallbackMethod_RenewKv<
            v1::KvTransfer::Service>>>;

class KvTransferService final : public RawKvTransferService {
 public:
  // All references must outlive the service; `metrics` may be null;
  // `nccl_comms` (null: no NCCL transport) keeps the communicators of
  // pulls over NCCL, one per puller.
  KvTransferService(KvLeaseTable& leases, Device& device, KvCacheView view,
                    std::string model_fingerprint,
                    const KvTransferServiceOptions& options,
                    WorkerMetrics* metrics, NcclCommCache* nccl_comms);
  ~KvTransferService() override;

  // PullKvRequest -> stream of KvChunk; ReleaseKvRequest ->
  // ReleaseKvResponse (proto/worker.proto), serialized.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullKv(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ReleaseKv(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  // RenewKvRequest -> RenewKvResponse.
  grpc::ServerUnaryReactor* RenewKv(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;

  // Whether pullers on this host may map our KV (CUDA device and the
  // allocation exported); KvHandle.transports lists "cuda_ipc" then.
  bool offers_cuda_ipc() const { return !ipc_handle_.empty(); }
  // Whether this worker serves pulls over NCCL (a communicator cache).
  bool offers_nccl() const { return nccl_sender_ != nullptr; }
  // This process's KvHandle.source_epoch: 32 random hex digits, new at
  // every start.
  const std::string& epoch() const { return epoch_; }

 private:
  KvLeaseTable& leases_;
  Device& device_;
  const KvCacheView view_;
  const std::string fingerprint_;
  const KvTransferServiceOptions options_;
  WorkerMetrics* const metrics_;
  // The KV allocation's cudaIpcMemHandle_t bytes; empty: no CUDA IPC.
  std::string ipc_handle_;
  NcclCommCache* const nccl_comms_;          // null: no NCCL
  std::unique_ptr<NcclSender> nccl_sender_;  // null: no NCCL
  const std::string epoch_;
  // Token-span chunks' buffers; after everything a pull uses, so that the
  // pulls (which hold stagings) end before it goes.
  KvSpanStagingPool span_stagings_;
};

// v1::KvLayout <-> KvLayoutInfo.
v1::KvLayout ToProto(const KvLayoutInfo& layout);
KvLayoutInfo FromProto(const v1::KvLayout& layout);

// FAILED_PRECONDITION naming both sides when a peer's model or KV layout
// differs from ours; `what` says who the peer is ("the KV handle", ...).
absl::Status CheckCompatible(absl::string_view what,
                             const std::string& their_fingerprint,
                             const KvLayoutInfo& their_layout,
                             const std::string& our_fingerprint,
                             const KvLayoutInfo& our_layout);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_KV_TRANSFER_SERVICE_H_
