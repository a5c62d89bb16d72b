#include "worker/transfer/nccl_transfer.h"

#include "pdw_cuda_config.h"  // PDW_HAVE_CUDA, PDW_HAVE_NCCL

#if PDW_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/runtime/cuda_stream.h"
#include "worker/runtime/stream.h"
#endif

namespace pdworker {

size_t NcclPayloadOffset(const KvCacheView& like, int32_t first_token) {
  return static_cast<size_t>(first_token) * like.token_bytes;
}

KvCacheView NcclPackedView(const KvCacheView& like, DeviceBuffer staging,
                           int32_t first_token, int32_t num_tokens) {
  // Part i starts (num_tokens - first_token) tokens after part i - 1 and
  // spans num_tokens tokens, so that its tokens from first_token on (the
  // only ones copied) follow part i - 1's: slices overlap only in tokens
  // nobody touches.
  KvCacheView packed;
  packed.layout = like.layout;
  packed.block_size = num_tokens;
  packed.token_bytes = like.token_bytes;
  packed.allocation = staging;
  const size_t part =
      static_cast<size_t>(num_tokens - first_token) * like.token_bytes;
  const size_t span = static_cast<size_t>(num_tokens) * like.token_bytes;
  for (int l = 0; l < like.layout.num_layers; ++l) {
    packed.keys.push_back(staging.Slice(2 * l * part, span));
    packed.values.push_back(staging.Slice((2 * l + 1) * part, span));
  }
  return packed;
}

#if PDW_HAVE_NCCL
namespace {

absl::Status NcclError(ncclResult_t result, const char* what) {
  return absl::UnavailableError(
      absl::StrCat(what, " failed: ", ncclGetErrorString(result)));
}

// Waits until `comm`'s pending non-blocking work (init, a group) is done;
// aborts the communicator and returns UNAVAILABLE past `deadline`.
absl::Status WaitForComm(ncclComm_t comm,
                         std::chrono::steady_clock::time_point deadline,
                         const char* what) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    if (got != ncclSuccess) return NcclError(got, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(state, what);
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the peer did not answer in time"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Waits for `stream`'s queued work (the NCCL send/recv kernel) without
// blocking in the driver: a kernel whose peer died mid-transfer spins
// forever, so cudaStreamSynchronize would hang the puller. Polls the stream
// and the communicator's async error until `deadline`.
absl::Status WaitForTransfer(cudaStream_t stream, ncclComm_t comm,
                             std::chrono::steady_clock::time_point deadline) {
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
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::UnavailableError(
          "the NCCL transfer: the peer did not finish in time");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Ends a communicator whose work completed: finalize (both ranks quiesce),
// then destroy. A peer that vanished after the transfer cannot make
// finalize hang past `deadline`: the communicator is aborted instead.
void EndCommunicator(ncclComm_t comm,
                     std::chrono::steady_clock::time_point deadline) {
  ncclResult_t r = ncclCommFinalize(comm);
  if ((r == ncclSuccess || r == ncclInProgress) &&
      WaitForComm(comm, deadline, "finalizing the NCCL pair").ok()) {
    ncclCommDestroy(comm);
    return;
  }
  ncclCommAbort(comm);
}

enum class Rank { kPuller = 0, kSource = 1 };

absl::Status Transfer(const NcclKvParams& p, Rank rank) {
  if (p.unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id is ", sizeof(ncclUniqueId),
                     " bytes, got ", p.unique_id.size()));
  }
  absl::StatusOr<std::unique_ptr<Stream>> stream = p.device->CreateStream();
  if (!stream.ok()) return stream.status();
  auto* cuda = dynamic_cast<CudaStream*>(stream->get());
  if (cuda == nullptr) {
    return absl::FailedPreconditionError("NCCL needs a CUDA device");
  }
  if (p.first_token < 0 || p.first_token >= p.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_token=", p.first_token, " outside [0, ", p.num_tokens, ")"));
  }
  // What moves: the payload after NcclPayloadOffset (see NcclPackedView).
  const size_t bytes =
      static_cast<size_t>(p.view->BytesFor(p.num_tokens - p.first_token));
  const size_t lead = NcclPayloadOffset(*p.view, p.first_token);
  absl::StatusOr<DeviceMemory> staging = p.device->Allocate(lead + bytes);
  if (!staging.ok()) return staging.status();
  void* payload = static_cast<char*>(staging->data()) + lead;
  const KvCacheView packed =
      NcclPackedView(*p.view, staging->buffer(), p.first_token, p.num_tokens);
  SequenceKv packed_seq;
  packed_seq.blocks = {0};
  packed_seq.num_tokens = p.num_tokens;

  if (rank == Rank::kSource) {
    absl::Status copied =
        CopyKvTokens(**stream, *p.view, *p.seq, packed, packed_seq,
                     p.num_tokens, KvCopyMethod::kAuto, p.first_token);
    if (!copied.ok()) return copied;
  }

  ncclUniqueId id;
  std::memcpy(&id, p.unique_id.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r =
      ncclCommInitRankConfig(&comm, 2, id, static_cast<int>(rank), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    return NcclError(r, "ncclCommInitRankConfig");
  }
  absl::Status status = WaitForComm(comm, p.deadline, "joining the NCCL pair");
  if (status.ok()) {
    r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = rank == Rank::kSource
              ? ncclSend(payload, bytes, ncclUint8, 0, comm, cuda->native())
              : ncclRecv(payload, bytes, ncclUint8, 1, comm, cuda->native());
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (r == ncclSuccess) r = ended;
    if (r != ncclSuccess && r != ncclInProgress) {
      status = NcclError(r, "ncclSend/ncclRecv");
    } else {
      status = WaitForComm(comm, p.deadline, "the NCCL transfer");
    }
  }
  if (status.ok()) {
    // The transfer is enqueued on the stream; wait for it, bounded.
    status = WaitForTransfer(cuda->native(), comm, p.deadline);
  }
  if (!status.ok()) {
    // Abort also stops a kernel still waiting for its peer, so the stream
    // drains and the staging buffer can be freed.
    ncclCommAbort(comm);
    return status;
  }
  // The bytes have arrived; a slow finalize must not fail the transfer.
  EndCommunicator(comm, std::max(p.deadline, std::chrono::steady_clock::now() +
                                                 std::chrono::seconds(1)));
  if (rank == Rank::kPuller) {
    absl::Status copied =
        CopyKvTokens(**stream, packed, packed_seq, *p.view, *p.seq,
                     p.num_tokens, KvCopyMethod::kAuto, p.first_token);
    if (copied.ok()) copied = (*stream)->Synchronize();
    return copied;
  }
  return absl::OkStatus();
}

}  // namespace

bool NcclTransportAvailable(const Device& device) {
  return device.kind() == DeviceKind::kCuda;
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::Status NcclSendKv(const NcclKvParams& params) {
  return Transfer(params, Rank::kSource);
}

absl::Status NcclRecvKv(const NcclKvParams& params) {
  return Transfer(params, Rank::kPuller);
}

#else  // !PDW_HAVE_NCCL

bool NcclTransportAvailable(const Device& /*device*/) { return false; }

absl::StatusOr<std::string> NewNcclUniqueId() {
  return absl::UnimplementedError("built without NCCL");
}

absl::Status NcclSendKv(const NcclKvParams& /*params*/) {
  return absl::UnimplementedError("built without NCCL");
}

absl::Status NcclRecvKv(const NcclKvParams& /*params*/) {
  return absl::UnimplementedError("built without NCCL");
}

#endif  // PDW_HAVE_NCCL

}  // namespace pdworker
