// The NCCL transport of the KV handoff, puller side: PullKv with transport
// "nccl" and a fresh unique id; once the source answers nccl_ready, both
// join the pair and the KV arrives by ncclRecv (see nccl_transfer.h).
#ifndef PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_
#define PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_

#include "absl/status/status.h"
#include "worker/runtime/device.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

// Same errors as PullKvOverGrpc. Outcome kInternal only when nothing was
// started on the source (no NCCL here or there): the caller may then fall
// back to the gRPC stream.
absl::Status PullKvOverNccl(PeerChannels& channels, Device& device,
                            const KvPullParams& params, KvPullStats* stats);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_NCCL_KV_PULLER_H_
