// The NCCL transport of the KV handoff, for a P/D pair on different GPUs
// (or hosts with GPUDirect): a 2-rank communicator per (source, puller)
// pair of workers, kept across transfers (NcclCommCache; rank 0 the
// puller, rank 1 the source), the lease's tokens [first_token, num_tokens)
// packed into one device buffer [layer][K, V][token] on the source, one
// ncclSend / ncclRecv, and an unpack into the puller's blocks.
//
// Communicators are made in non-blocking mode and every wait on them is
// bounded: a peer that does not join or finish by the deadline, or a
// communicator the cache drops meanwhile, ends in ncclCommAbort, so a dead
// peer costs a bounded wait, never a hang.
//
// Built without NCCL or CUDA (PDW_HAVE_NCCL=0) the factory's calls return
// UNIMPLEMENTED and workers do not offer the transport.
#ifndef PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_
#define PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device.h"
#include "worker/transfer/nccl_comm_cache.h"

namespace pdworker {

// True when this binary can move KV over NCCL (and the device is CUDA).
bool NcclTransportAvailable(const Device& device);

// The device memory a kept communicator takes on each side, which the worker
// keeps free for --nccl_max_peers of them. NCCL gives each point-to-point
// channel between the two ranks one FIFO per protocol, with its defaults
// (NVIDIA/nccl src/init.cc): Simple NCCL_BUFFSIZE = 4 MiB, LL128
// NCCL_LL128_BUFFSIZE = 4.6875 MiB, LL NCCL_LL_BUFFSIZE = 0.5 MiB;
// src/transport/p2p.cc allocates them on the receiver (Simple on the sender
// under P2P read), so one side holds at most 9.1875 MiB per channel. Our
// communicators are made with maxCTAs = kNcclMaxChannels (left to itself,
// NCCL may pick more on NVLink), so 8 channels: 73.5 MiB, rounded up to
// 80 MiB for the communicator's own device state. Raising the NCCL_*BUFFSIZE
// environment variables raises the real cost past this figure.
inline constexpr int kNcclMaxChannels = 8;
inline constexpr size_t kNcclCommDeviceBytes = size_t{80} << 20;

// NCCL's communicators (ncclCommInitRankConfig, non-blocking, as rank 0 or
// 1 of 2; ncclCommAbort on destruction). Without NCCL its calls return
// UNIMPLEMENTED.
std::unique_ptr<NcclCommFactory> NewNcclCommFactory();

struct NcclKvParams {
  Device* device = nullptr;
  const KvCacheView* view = nullptr;
  const SequenceKv* seq = nullptr;  // source: the lease; puller: reserved
  int32_t num_tokens = 0;
  std::chrono::steady_clock::time_point deadline;  // join + transfer
  int32_t first_token = 0;  // tokens [first_token, num_tokens) move
};

// Rank 1: sends tokens [first_token, num_tokens) of `seq` through `comm`,
// joining it first when it is new.
absl::Status NcclSendKv(const NcclKvParams& params, NcclCommCache::Lease& comm);
// Rank 0: receives them into `seq`'s blocks.
absl::Status NcclRecvKv(const NcclKvParams& params, NcclCommCache::Lease& comm);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_NCCL_TRANSFER_H_
