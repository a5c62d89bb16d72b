// The NCCL transport of the KV handoff, puller side: PullKv with transport
// "nccl", naming the communicator this worker keeps with the source (or a
// new one's unique id); once the source answers nccl_ready, the KV arrives
// by ncclRecv (see nccl_transfer.h, nccl_comm_cache.h).
#ifndef PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_
#define PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_

#include <string>

#include "absl/status/status.h"
#include "worker/runtime/device.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/nccl_comm_cache.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

// Same errors as PullKvOverGrpc. The pair's communicator comes from
// `comms`, keyed by the source's address and epoch, and is kept for the
// next pull unless the pull fails in transport (or the source keeps none);
// a source that no longer has it (ABORTED) gets a new one, once.
// `puller_id` names this process to sources (PullKvRequest.nccl_puller_id).
// Outcome kInternal only when nothing was started on the source (no NCCL
// here or there, no room for a communicator here or there): the caller may
// then fall back to the gRPC stream.
absl::Status PullKvOverNccl(PeerChannels& channels, Device& device,
                            NcclCommCache& comms, const std::string& puller_id,
                            const KvPullParams& params, KvPullStats* stats);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_
