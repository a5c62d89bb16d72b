#include "worker/transfer/nccl_kv_puller.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/worker.pb.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {
namespace {

// The source refused before granting anything, for a reason that says
// nothing about the communicator (the lease, the handle, the model).
bool IsRefusal(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNIMPLEMENTED:
      return true;
    default:
      return false;
  }
}

}  // namespace

absl::Status PullKvOverNccl(PeerChannels& channels, Device& device,
                            NcclCommCache& comms, const std::string& puller_id,
                            const KvPullParams& p, KvPullStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  KvTransferOutcome outcome = KvTransferOutcome::kOk;
  const int32_t n = p.handle->num_tokens();
  auto finish = [&](absl::Status status) {
    RecordPullStats(stats, start,
                    status.ok() ? p.view->BytesFor(n - p.first_token) : 0,
                    outcome);
    return status;
  };
  const std::string& source = p.handle->source_address();
  const auto deadline = std::min(p.call_deadline, p.pull_deadline);
  const auto steady_deadline =
      start + (deadline - std::chrono::system_clock::now());
  for (int attempt = 0;; ++attempt) {
    // Waits while another import uses the pair. The source's epoch names
    // its process: a restarted source gets a new communicator.
    absl::StatusOr<NcclCommCache::Lease> comm =
        comms.Acquire(source, p.handle->source_epoch(), steady_deadline);
    if (!comm.ok()) {
      switch (comm.status().code()) {
        case absl::StatusCode::kResourceExhausted:  // no room: fall back
          outcome = KvTransferOutcome::kInternal;
          break;
        case absl::StatusCode::kDeadlineExceeded:
          if (std::chrono::system_clock::now() >= p.call_deadline) {
            outcome = KvTransferOutcome::kDeadline;
            return finish(comm.status());
          }
          outcome = KvTransferOutcome::kTransportError;
          return finish(absl::UnavailableError(comm.status().message()));
        case absl::StatusCode::kUnavailable:  // shutting down
          outcome = KvTransferOutcome::kCancelled;
          break;
        default:  // no unique id: nothing started anywhere
          outcome = KvTransferOutcome::kInternal;
      }
      return finish(comm.status());
    }
    const bool fresh = !comm->joined();
    v1::PullKvRequest request = PullRequestFor(p, "nccl");
    request.set_nccl_puller_id(puller_id);
    request.set_nccl_comm_generation(comm->generation());
    if (fresh) request.set_nccl_unique_id(comm->unique_id());
    grpc::ClientContext context;
    context.set_deadline(deadline);
    KvChunkReader reader(*channels.Get(source), &context, request);
    v1::KvChunk chunk;
    KvChunkReader::Next next = reader.Read(&chunk);
    const bool ready =
        next == KvChunkReader::Next::kChunk && chunk.nccl_ready();
    absl::Status received = absl::OkStatus();
    if (ready) {
      // An older source joins for this pull only.
      if (fresh && !chunk.nccl_comm_kept()) comm->Drop();
      NcclKvParams params;
      params.device = &device;
      params.view = p.view;
      params.seq = p.destination;
      params.first_token = p.first_token;
      params.num_tokens = n;
      params.deadline = steady_deadline;
      received = NcclRecvKv(params, *comm);  // a failure drops the pair
      if (!received.ok()) context.TryCancel();
    }
    while (next == KvChunkReader::Next::kChunk) next = reader.Read(&chunk);
    const grpc::Status finished = reader.Finish();
    if (next == KvChunkReader::Next::kMalformed) {
      comm->Drop();
      outcome = KvTransferOutcome::kMalformedStream;
      return finish(absl::InternalError(
          absl::StrCat("malformed KV stream from ", source,
                       ": a message that is not a KvChunk")));
    }
    if (!ready && !fresh && attempt == 0 &&
        finished.error_code() == grpc::StatusCode::ABORTED) {
      // The source no longer has our communicator (it restarted, made room
      // for another puller, or dropped it after a failure): nothing was
      // granted, so pull again over a new one. `comm` is released first.
      comm->Drop();
      continue;
    }
    if (!received.ok() || (ready && !finished.ok()) ||
        (!ready && !finished.ok() && !IsRefusal(finished.error_code()))) {
      // The source is unreachable, or the transfer broke on either side:
      // its end of the pair is suspect.
      comm->Drop();
    }
    // No NCCL there, or no room for a communicator: fall back.
    if (!ready && finished.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      outcome = KvTransferOutcome::kInternal;
      return finish(absl::UnimplementedError(finished.error_message()));
    }
    if (!ready &&
        finished.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      outcome = KvTransferOutcome::kInternal;
      return finish(absl::ResourceExhaustedError(finished.error_message()));
    }
    if (!received.ok()) {
      outcome = KvTransferOutcome::kTransportError;
      return finish(absl::UnavailableError(
          absl::StrCat("NCCL pull from ", source, ": ", received.message())));
    }
    return finish(ClassifyPullEnd(p, finished, ready, 0, &outcome));
  }
}

}  // namespace pdworker
