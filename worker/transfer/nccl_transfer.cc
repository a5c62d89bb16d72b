#include "worker/transfer/nccl_transfer.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL
#include "worker/runtime/stream.h"
#include "worker/runtime/stream_fence.h"

#if PDW_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "worker/runtime/cuda_stream.h"
#endif

namespace pdworker {

namespace {

// Packs (source) or unpacks (puller) around one transfer through `comm`.
absl::Status Transfer(const NcclKvParams& p, NcclRank rank,
                      NcclCommCache::Lease& comm) {
  if (p.first_token < 0 || p.first_token >= p.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_token=", p.first_token, " outside [0, ", p.num_tokens, ")"));
  }
  // Also makes the device current on this thread, which a join needs.
  absl::StatusOr<std::unique_ptr<Stream>> stream = p.device->CreateStream();
  if (!stream.ok()) return stream.status();
  // What moves: tokens [first_token, num_tokens) as one packed span.
  const int32_t count = p.num_tokens - p.first_token;
  const size_t bytes = static_cast<size_t>(p.view->BytesFor(count));
  absl::StatusOr<DeviceMemory> staging = p.device->Allocate(bytes);
  if (!staging.ok()) return staging.status();
  void* payload = staging->data();
  // Destroyed before `staging`: the packing and unpacking queued on the
  // stream have run on every path out of here.
  StreamFence moved_through_staging(**stream);
  if (rank == NcclRank::kSource) {
    absl::Status packed = GatherKvSpan(**stream, *p.view, *p.seq, p.first_token,
                                       count, staging->buffer());
    if (!packed.ok()) return packed;
  }
  // A failed call aborts the communicator before returning, so nothing
  // still writes into `staging` when it is freed.
  absl::Status moved = comm.Join(rank, p.deadline);
  if (moved.ok()) {
    moved = rank == NcclRank::kSource
                ? comm.Send(payload, bytes, **stream, p.deadline)
                : comm.Recv(payload, bytes, **stream, p.deadline);
  }
  if (!moved.ok() || rank == NcclRank::kSource) return moved;
  absl::Status unpacked = ScatterKvSpan(**stream, staging->buffer(), *p.view,
                                        *p.seq, p.first_token, count);
  if (unpacked.ok()) unpacked = moved_through_staging.Wait();
  return unpacked;
}

}  // namespace

absl::Status NcclSendKv(const NcclKvParams& params,
                        NcclCommCache::Lease& comm) {
  return Transfer(params, NcclRank::kSource, comm);
}

absl::Status NcclRecvKv(const NcclKvParams& params,
                        NcclCommCache::Lease& comm) {
  return Transfer(params, NcclRank::kPuller, comm);
}

#if PDW_HAVE_NCCL
namespace {

absl::Status NcclError(ncclResult_t result, const char* what) {
  return absl::UnavailableError(
      absl::StrCat(what, " failed: ", ncclGetErrorString(result)));
}

absl::Status Aborted(const char* what) {
  return absl::UnavailableError(absl::StrCat(
      what, ": the communicator was dropped (peer gone or shutting down)"));
}

// Waits until `comm`'s pending non-blocking work (init, a group) is done;
// UNAVAILABLE past the deadline or once aborted (the caller aborts `comm`).
absl::Status WaitForComm(ncclComm_t comm, const NcclWait& wait,
                         const char* what) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    if (got != ncclSuccess) return NcclError(got, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(state, what);
    if (wait.aborted()) return Aborted(what);
    if (std::chrono::steady_clock::now() >= wait.deadline) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the peer did not answer in time"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Waits for `stream`'s queued work (the NCCL send/recv kernel) without
// blocking in the driver: a kernel whose peer died mid-transfer spins
// forever, so cudaStreamSynchronize would hang. Polls the stream and the
// communicator's async error until the deadline or an abort.
absl::Status WaitForTransfer(cudaStream_t stream, ncclComm_t comm,
                             const NcclWait& wait) {
  for (;;) {
    const cudaError_t queried = cudaStreamQuery(stream);
    if (queried == cudaSuccess) return absl::OkStatus();
    if (queried != cudaErrorNotReady) {
      return absl::UnavailableError(absl::StrCat("the NCCL transfer failed: ",
                                                 cudaGetErrorString(queried)));
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    if (got != ncclSuccess) return NcclError(got, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclError(state, "the NCCL transfer");
    }
    if (wait.aborted()) return Aborted("the NCCL transfer");
    if (std::chrono::steady_clock::now() >= wait.deadline) {
      return absl::UnavailableError(
          "the NCCL transfer: the peer did not finish in time");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// One rank of a joined pair; the peer is the other rank.
class NcclPairComm final : public NcclComm {
 public:
  NcclPairComm(ncclComm_t comm, NcclRank rank) : comm_(comm), rank_(rank) {}
  // Abort, not finalize + destroy: it never waits for the peer, and stops a
  // kernel still waiting for it (so its stream drains).
  ~NcclPairComm() override { ncclCommAbort(comm_); }

  absl::Status Send(const void* data, size_t bytes, Stream& stream,
                    const NcclWait& wait) override {
    return Move(const_cast<void*>(data), bytes, stream, wait);
  }
  absl::Status Recv(void* data, size_t bytes, Stream& stream,
                    const NcclWait& wait) override {
    return Move(data, bytes, stream, wait);
  }

 private:
  absl::Status Move(void* data, size_t bytes, Stream& stream,
                    const NcclWait& wait) {
    auto* cuda = dynamic_cast<CudaStream*>(&stream);
    if (cuda == nullptr) {
      return absl::FailedPreconditionError("NCCL needs a CUDA stream");
    }
    const int peer = rank_ == NcclRank::kSource ? 0 : 1;
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = rank_ == NcclRank::kSource
              ? ncclSend(data, bytes, ncclUint8, peer, comm_, cuda->native())
              : ncclRecv(data, bytes, ncclUint8, peer, comm_, cuda->native());
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (r == ncclSuccess) r = ended;
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclError(r, "ncclSend/ncclRecv");
    }
    absl::Status status = WaitForComm(comm_, wait, "the NCCL transfer");
    // The transfer is enqueued on the stream; wait for it, bounded.
    if (status.ok()) status = WaitForTransfer(cuda->native(), comm_, wait);
    return status;
  }

  const ncclComm_t comm_;
  const NcclRank rank_;
};

class NcclFactory final : public NcclCommFactory {
 public:
  absl::StatusOr<std::string> NewUniqueId() override {
    ncclUniqueId id;
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
  }

  absl::StatusOr<std::unique_ptr<NcclComm>> Join(
      const std::string& unique_id, NcclRank rank,
      const NcclWait& wait) override {
    if (unique_id.size() != sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError(
          absl::StrCat("an NCCL unique id is ", sizeof(ncclUniqueId),
                       " bytes, got ", unique_id.size()));
    }
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Bounds the channels, hence the buffers (kNcclCommDeviceBytes).
    config.maxCTAs = kNcclMaxChannels;
    ncclComm_t comm = nullptr;
    const ncclResult_t r =
        ncclCommInitRankConfig(&comm, 2, id, static_cast<int>(rank), &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr) ncclCommAbort(comm);
      return NcclError(r, "ncclCommInitRankConfig");
    }
    absl::Status joined = WaitForComm(comm, wait, "joining the NCCL pair");
    if (!joined.ok()) {
      ncclCommAbort(comm);
      return joined;
    }
    return std::unique_ptr<NcclComm>(new NcclPairComm(comm, rank));
  }
};

}  // namespace

bool NcclTransportAvailable(const Device& device) {
  return device.kind() == DeviceKind::kCuda;
}

std::unique_ptr<NcclCommFactory> NewNcclCommFactory() {
  return std::make_unique<NcclFactory>();
}

#else  // !PDW_HAVE_NCCL

namespace {

class NoNcclFactory final : public NcclCommFactory {
 public:
  absl::StatusOr<std::string> NewUniqueId() override {
    return absl::UnimplementedError("built without NCCL");
  }
  absl::StatusOr<std::unique_ptr<NcclComm>> Join(
      const std::string& /*unique_id*/, NcclRank /*rank*/,
      const NcclWait& /*wait*/) override {
    return absl::UnimplementedError("built without NCCL");
  }
};

}  // namespace

bool NcclTransportAvailable(const Device& /*device*/) { return false; }

std::unique_ptr<NcclCommFactory> NewNcclCommFactory() {
  return std::make_unique<NoNcclFactory>();
}

#endif  // PDW_HAVE_NCCL

}  // namespace pdworker
