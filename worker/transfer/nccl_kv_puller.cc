#include "worker/transfer/nccl_kv_puller.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/worker.grpc.pb.h"
#include "worker/transfer/kv_transfer_service.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {

absl::Status PullKvOverNccl(PeerChannels& channels, Device& device,
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

  absl::StatusOr<std::string> id = NewNcclUniqueId();
  if (!id.ok()) {
    outcome = KvTransferOutcome::kInternal;
    return finish(id.status());
  }
  v1::KvTransfer::Stub stub(channels.Get(p.handle->source_address()));
  grpc::ClientContext context;
  const auto deadline = std::min(p.call_deadline, p.pull_deadline);
  context.set_deadline(deadline);
  v1::PullKvRequest request = PullRequestFor(p, "nccl");
  request.set_nccl_unique_id(*id);
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
      stub.PullKv(&context, request);
  v1::KvChunk chunk;
  const bool ready = reader->Read(&chunk) && chunk.nccl_ready();
  absl::Status received = absl::OkStatus();
  if (ready) {
    NcclKvParams params;
    params.device = &device;
    params.view = p.view;
    params.seq = p.destination;
    params.first_token = p.first_token;
    params.num_tokens = n;
    params.unique_id = *id;
    params.deadline = std::chrono::steady_clock::now() +
                      (deadline - std::chrono::system_clock::now());
    received = NcclRecvKv(params);
    if (!received.ok()) context.TryCancel();
  }
  while (reader->Read(&chunk)) {
  }
  const grpc::Status finished = reader->Finish();
  if (!ready && finished.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    outcome = KvTransferOutcome::kInternal;  // no NCCL there: fall back
    return finish(absl::UnimplementedError(finished.error_message()));
  }
  if (!received.ok()) {
    outcome = KvTransferOutcome::kTransportError;
    return finish(absl::UnavailableError(
        absl::StrCat("NCCL pull from ", p.handle->source_address(), ": ",
                     received.message())));
  }
  return finish(ClassifyPullEnd(p, finished, ready, 0, &outcome));
}

}  // namespace pdworker
