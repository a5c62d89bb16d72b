#include "worker/transfer/cuda_ipc_puller.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/worker.grpc.pb.h"
#include "worker/runtime/stream_fence.h"
#include "worker/transfer/kv_transfer_service.h"

namespace pdworker {

absl::StatusOr<KvCacheView> ViewOfExport(const v1::CudaIpcExport& e,
                                         DeviceBuffer mapped,
                                         const KvCacheView& ours,
                                         int32_t num_tokens) {
  const int layers = ours.layout.num_layers;
  if (e.key_offsets_size() != layers || e.value_offsets_size() != layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA IPC export has ", e.key_offsets_size(), "/",
        e.value_offsets_size(), " layer offsets, expected ", layers));
  }
  if (e.block_size() <= 0 || e.num_tokens() != num_tokens ||
      e.blocks_size() !=
          (int64_t{num_tokens} + e.block_size() - 1) / e.block_size()) {
    return absl::InvalidArgumentError(
        "CUDA IPC export's block table does not match its token count");
  }
  const int64_t block_bytes =
      static_cast<int64_t>(e.block_size()) * ours.token_bytes;
  const int64_t per_layer = e.cache_bytes_per_layer();
  if (per_layer <= 0 || per_layer % block_bytes != 0) {
    return absl::InvalidArgumentError(
        "CUDA IPC export's cache size is not whole blocks");
  }
  for (const int32_t b : e.blocks()) {
    if (b < 0 || b >= per_layer / block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CUDA IPC export names block ", b, " outside the source's cache"));
    }
  }
  KvCacheView view;
  view.layout = ours.layout;
  view.block_size = e.block_size();
  view.token_bytes = ours.token_bytes;
  view.allocation = mapped;
  for (int l = 0; l < layers; ++l) {
    for (const int64_t offset : {e.key_offsets(l), e.value_offsets(l)}) {
      if (offset < 0 ||
          offset > static_cast<int64_t>(mapped.size_bytes()) - per_layer) {
        return absl::InvalidArgumentError(
            "CUDA IPC export's offsets exceed its allocation");
      }
    }
    view.keys.push_back(mapped.Slice(e.key_offsets(l), per_layer));
    view.values.push_back(mapped.Slice(e.value_offsets(l), per_layer));
  }
  return view;
}

absl::Status PullKvOverCudaIpc(PeerChannels& channels,
                               CudaIpcMappings& mappings, const KvPullParams& p,
                               KvPullStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  KvTransferOutcome outcome = KvTransferOutcome::kOk;
  const int32_t n = p.handle->num_tokens();
  // The copies into the destination blocks (and out of the mapping) have
  // run on every path out, also when one of them failed to enqueue.
  StreamFence copied_into_blocks(*p.stream);
  auto finish = [&](absl::Status status) {
    RecordPullStats(stats, start,
                    status.ok() ? p.view->BytesFor(n - p.first_token) : 0,
                    outcome);
    return status;
  };

  // 1. Where the lease lives.
  grpc::ClientContext context;
  context.set_deadline(std::min(p.call_deadline, p.pull_deadline));
  const v1::PullKvRequest request = PullRequestFor(p, "cuda_ipc");
  KvChunkReader reader(*channels.Get(p.handle->source_address()), &context,
                       request);
  // The answer is one chunk: the export record.
  v1::KvChunk chunk;
  int chunks = 0;
  KvChunkReader::Next next;
  while ((next = reader.Read(&chunk)) == KvChunkReader::Next::kChunk) {
    if (++chunks > 1 || !chunk.has_cuda_ipc()) {
      context.TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader.Finish();
  if (next == KvChunkReader::Next::kMalformed) {
    outcome = KvTransferOutcome::kMalformedStream;
    return finish(absl::InternalError(
        absl::StrCat("malformed KV stream from ", p.handle->source_address(),
                     ": a message that is not a KvChunk")));
  }
  if (next == KvChunkReader::Next::kChunk) {  // stopped early
    outcome = KvTransferOutcome::kMalformedStream;
    return finish(absl::InternalError(absl::StrCat(
        "malformed KV stream from ", p.handle->source_address(),
        ": a CUDA IPC pull is answered with one export record, got ",
        chunks > 1 ? "a second chunk" : "a chunk without one")));
  }
  const bool got = chunks == 1;
  if (finished.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    outcome = KvTransferOutcome::kInternal;  // no IPC there: fall back
    return finish(absl::UnimplementedError(finished.error_message()));
  }
  absl::Status ended = ClassifyPullEnd(p, finished, got, 0, &outcome);
  if (!ended.ok()) return finish(ended);

  // 2. Map and copy.
  const v1::CudaIpcExport& e = chunk.cuda_ipc();
  absl::StatusOr<DeviceBuffer> mapped =
      mappings.Open(e.mem_handle(), static_cast<size_t>(e.allocation_bytes()));
  if (!mapped.ok()) {
    outcome = KvTransferOutcome::kInternal;
    return finish(mapped.status());
  }
  absl::StatusOr<KvCacheView> source = ViewOfExport(e, *mapped, *p.view, n);
  if (!source.ok()) {
    outcome = KvTransferOutcome::kMalformedStream;
    return finish(absl::InternalError(source.status().message()));
  }
  SequenceKv source_seq;
  source_seq.blocks.assign(e.blocks().begin(), e.blocks().end());
  source_seq.num_tokens = n;
  // Only the tokens the puller's prefix cache did not hold.
  absl::Status copied =
      CopyKvTokens(*p.stream, *source, source_seq, *p.view, *p.destination, n,
                   KvCopyMethod::kAuto, p.first_token);
  if (copied.ok()) copied = copied_into_blocks.Wait();
  if (!copied.ok()) outcome = KvTransferOutcome::kInternal;
  return finish(copied);
}

}  // namespace pdworker
