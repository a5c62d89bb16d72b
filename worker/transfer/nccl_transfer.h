// The NCCL transport of the KV handoff, for a P/D pair on different GPUs
// (or hosts with GPUDirect): a 2-rank communicator per transfer (rank 0 the
// puller, rank 1 the source; the unique id travels in PullKvRequest), the
// lease's tokens [first_token, num_tokens) packed into one device buffer
// [layer][K, V][token] on the source, one ncclSend / ncclRecv, and an unpack
// into the puller's blocks.
//
// Communicators are created in non-blocking mode and abandoned
// (ncclCommAbort) when the peer does not join or finish within `timeout`,
// so a dead peer costs a bounded wait, never a hang.
//
// Built without NCCL or CUDA (PDW_HAVE_NCCL=0) every call returns
// UNIMPLEMENTED and workers do not offer the transport.
#ifndef PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_
#define PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runtime/device.h"
#include "worker/transfer/kv_cache_view.h"

namespace pdworker {

// True when this binary can move KV over NCCL (and the device is CUDA).
bool NcclTransportAvailable(const Device& device);

// The staging buffer of a transfer of tokens [first_token, num_tokens):
// NcclPayloadOffset(like, first_token) bytes (first_token tokens' rows),
// then the payload that moves, BytesFor(num_tokens - first_token) bytes laid
// out [layer][K, V][token]. As a KvCacheView of one block of num_tokens
// tokens per layer part (block table {0}), CopyKvTokens with `first_token`
// packs a sequence's tokens into the payload and unpacks them from it; the
// parts' slices overlap only in tokens before first_token, which are never
// copied.
size_t NcclPayloadOffset(const KvCacheView& like, int32_t first_token);
KvCacheView NcclPackedView(const KvCacheView& like, DeviceBuffer staging,
                           int32_t first_token, int32_t num_tokens);

// A fresh ncclUniqueId (128 bytes), made by the puller.
absl::StatusOr<std::string> NewNcclUniqueId();

struct NcclKvParams {
  Device* device = nullptr;
  const KvCacheView* view = nullptr;
  const SequenceKv* seq = nullptr;  // source: the lease; puller: reserved
  int32_t num_tokens = 0;
  std::string unique_id;
  std::chrono::steady_clock::time_point deadline;  // join + transfer
  int32_t first_token = 0;  // tokens [first_token, num_tokens) move
};

// Rank 1: sends tokens [first_token, num_tokens) of `seq`.
absl::Status NcclSendKv(const NcclKvParams& params);
// Rank 0: receives them into `seq`'s blocks.
absl::Status NcclRecvKv(const NcclKvParams& params);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_
