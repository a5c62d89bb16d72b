// GrpcKvPuller: the gRPC streaming transport of the KV handoff, puller side.
// Opens PullKv on the prefill worker named by the handle and writes each
// chunk into the blocks reserved for the import, checking that the chunks
// tile tokens [first_token, num_tokens) of every layer's K and V exactly
// once, in order: token spans of every layer (one upload and one scatter
// per chunk, KvSpanStaging) or, from sources that predate them, layer runs.
#ifndef PDWORKER_WORKER_TRANSFER_GRPC_KV_PULLER_H_
#define PDWORKER_WORKER_TRANSFER_GRPC_KV_PULLER_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "metrics/worker_metrics.h"
#include "proto/worker.pb.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/kv_span_staging.h"
#include "worker/transfer/peer_channels.h"

namespace pdworker {

struct KvPullStats {
  int64_t bytes = 0;
  double seconds = 0.0;
  KvTransferOutcome outcome = KvTransferOutcome::kOk;
};

// Fills `stats` (when not null) at the end of a pull that began at `start`;
// every transport's puller reports through this.
void RecordPullStats(KvPullStats* stats,
                     std::chrono::steady_clock::time_point start, int64_t bytes,
                     KvTransferOutcome outcome);

struct KvPullParams {
  const v1::KvHandle* handle = nullptr;
  std::string model_fingerprint;  // ours, checked by the source as well
  const KvCacheView* view = nullptr;
  const SequenceKv* destination = nullptr;  // handle->num_tokens tokens
  // Tokens [first_token, handle->num_tokens) are pulled; the ones before
  // are in `destination` already (prefix cache hit). 0: all.
  int32_t first_token = 0;
  // The ids the puller will cache the blocks under (the handle's
  // prompt_token_ids; empty: none): sent for the source to check.
  absl::Span<const int32_t> token_ids;
  Stream* stream = nullptr;  // for the copies into the cache
  // Token-span chunks' buffers (KvSpanStaging): the gRPC stream asks for
  // KV_CHUNK_LAYOUT_TOKEN_SPAN when set (and a staging can be had), else
  // for layer runs, copied block by block on `stream`.
  KvSpanStagingPool* span_stagings = nullptr;
  // The import's own deadline (the ImportKv caller's) and the bound on the
  // pull (no progress from a hung source lasts longer than this).
  std::chrono::system_clock::time_point call_deadline;
  std::chrono::system_clock::time_point pull_deadline;
};

// Errors: the source's NOT_FOUND / FAILED_PRECONDITION (expired, already
// pulled, other model) with its message; UNAVAILABLE when the source cannot
// be reached, dies or stalls past pull_deadline; DEADLINE_EXCEEDED when
// call_deadline passed; INTERNAL for a malformed stream. `stats` (may be
// null) gets the bytes received and the outcome (for metrics) either way.
// Returns once every write into the destination blocks has run, on success
// and on error alike (the caller frees the blocks after a failed pull).
absl::Status PullKvOverGrpc(PeerChannels& channels, const KvPullParams& params,
                            KvPullStats* stats);

// A PullKv stream, every transport's puller side. Messages are read raw and
// parsed here: gRPC's typed reader reports a message that does not parse
// as the end of the stream, and Finish() then waits behind the source's
// unread messages until the deadline (tests/fuzz/kv_stream_fuzz found a
// source's garbage holding an import for the whole pull timeout). A
// malformed message must fail the pull at once.
class KvChunkReader {
 public:
  // Starts the call; `context` (deadline set) must outlive the reader.
  KvChunkReader(grpc::Channel& channel, grpc::ClientContext* context,
                const v1::PullKvRequest& request);

  enum class Next { kChunk, kEnd, kMalformed };
  // kMalformed: the message was not a KvChunk; the call is cancelled.
  Next Read(v1::KvChunk* chunk);
  // The source's status (after kEnd), or CANCELLED (after a cancel).
  grpc::Status Finish() { return reader_->Finish(); }

 private:
  grpc::ClientContext* context_;
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader_;
};

// The PullKv request for `params` over `transport` ("grpc", "cuda_ipc",
// "nccl").
v1::PullKvRequest PullRequestFor(const KvPullParams& params,
                                 absl::string_view transport);

// How a PullKv stream ended, for any transport: the import's status and the
// metrics outcome. `complete`: the puller got everything it expected.
absl::Status ClassifyPullEnd(const KvPullParams& params,
                             const grpc::Status& finished, bool complete,
                             int64_t bytes, KvTransferOutcome* outcome);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_GRPC_KV_PULLER_H_
