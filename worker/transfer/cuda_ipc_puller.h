// The CUDA IPC transport of the KV handoff, puller side: asks the source for
// the lease's location in its GPU memory (PullKv with transport
// "cuda_ipc"), maps the source's KV allocation and copies the lease's tokens
// from params.first_token on device to device into the blocks reserved for
// the import.
#ifndef PDWORKER_WORKER_TRANSFER_CUDA_IPC_PULLER_H_
#define PDWORKER_WORKER_TRANSFER_CUDA_IPC_PULLER_H_

#include "absl/status/status.h"
#include "proto/worker.pb.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

// The source's KV cache as seen through `mapped` (its allocation, mapped
// here). INVALID_ARGUMENT when the export does not fit the allocation, the
// layout or the token count.
absl::StatusOr<KvCacheView> ViewOfExport(const v1::CudaIpcExport& exported,
                                         DeviceBuffer mapped,
                                         const KvCacheView& ours,
                                         int32_t num_tokens);

// Same errors as PullKvOverGrpc; a local failure (the mapping is refused,
// the copy fails, the source offers no IPC) has outcome kInternal, after
// which the caller may fall back to the gRPC stream: the lease is still
// pullable.
absl::Status PullKvOverCudaIpc(PeerChannels& channels,
                               CudaIpcMappings& mappings,
                               const KvPullParams& params, KvPullStats* stats);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_CUDA_IPC_PULLER_H_
