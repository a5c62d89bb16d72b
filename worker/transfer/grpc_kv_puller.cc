#include "worker/transfer/grpc_kv_puller.h"

// The stubs' own reader factory and method descriptor: a PullKv reader of
// raw messages (see KvChunkReader).
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/worker.grpc.pb.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/rpc/status_mapping.h"
#include "worker/runtime/stream_fence.h"
#include "worker/transfer/kv_transfer_service.h"

namespace pdworker {
namespace {

// Where the next chunk must start: layers in order, K before V, tokens
// contiguous from first_token to num_tokens.
struct Cursor {
  int layer = 0;
  KvCachePart part = KvCachePart::kKey;
  int32_t next_token = 0;  // starts at KvPullParams::first_token
};

absl::Status ApplyChunk(const KvPullParams& p, const v1::KvChunk& chunk,
                        Cursor& cursor, KvTransferOutcome* outcome) {
  *outcome = KvTransferOutcome::kMalformedStream;
  const int32_t n = p.handle->num_tokens();
  const KvCachePart part = chunk.part() == v1::KvChunk::PART_KEY
                               ? KvCachePart::kKey
                               : KvCachePart::kValue;
  if (cursor.layer >= p.view->layout.num_layers ||
      chunk.layer() != cursor.layer ||
      chunk.part() == v1::KvChunk::PART_UNSPECIFIED || part != cursor.part ||
      chunk.first_token() != cursor.next_token || chunk.num_tokens() <= 0 ||
      chunk.num_tokens() > n - cursor.next_token) {
    return absl::InternalError(
        absl::StrCat("malformed KV stream: got layer ", chunk.layer(), " part ",
                     chunk.part(), " tokens [", chunk.first_token(), ", +",
                     chunk.num_tokens(), "), expected layer ", cursor.layer,
                     " part ", cursor.part == KvCachePart::kKey ? "K" : "V",
                     " from token ", cursor.next_token));
  }
  const size_t expected =
      static_cast<size_t>(chunk.num_tokens()) * p.view->token_bytes;
  if (chunk.data().size() != expected) {
    return absl::InternalError(absl::StrCat(
        "malformed KV stream: chunk of ", chunk.num_tokens(), " tokens has ",
        chunk.data().size(), " bytes, expected ", expected));
  }
  const KvTokenRun run{chunk.layer(), part, chunk.first_token(),
                       chunk.num_tokens()};
  absl::Status written = WriteKvTokens(*p.stream, *p.view, *p.destination, run,
                                       chunk.data().data());
  if (!written.ok()) return written;
  cursor.next_token += chunk.num_tokens();
  if (cursor.next_token == n) {
    cursor.next_token = p.first_token;
    if (cursor.part == KvCachePart::kKey) {
      cursor.part = KvCachePart::kValue;
    } else {
      cursor.part = KvCachePart::kKey;
      ++cursor.layer;
    }
  }
  return absl::OkStatus();
}

// A KV_CHUNK_LAYOUT_TOKEN_SPAN chunk: the next run of tokens of every
// layer, uploaded and scattered through `staging`.
absl::Status ApplySpanChunk(const KvPullParams& p, const v1::KvChunk& chunk,
                            int32_t& next_token, KvSpanStaging& staging,
                            KvTransferOutcome* outcome) {
  *outcome = KvTransferOutcome::kMalformedStream;
  const int32_t n = p.handle->num_tokens();
  if (chunk.layer() != 0 || chunk.part() != v1::KvChunk::PART_UNSPECIFIED ||
      chunk.first_token() != next_token || chunk.num_tokens() <= 0 ||
      chunk.num_tokens() > n - next_token) {
    return absl::InternalError(absl::StrCat(
        "malformed KV stream: got a token span of layer ", chunk.layer(),
        " part ", chunk.part(), " tokens [", chunk.first_token(), ", +",
        chunk.num_tokens(), "), expected every layer from token ", next_token,
        " of ", n));
  }
  const int64_t expected = p.view->BytesFor(chunk.num_tokens());
  if (static_cast<int64_t>(chunk.data().size()) != expected) {
    return absl::InternalError(absl::StrCat(
        "malformed KV stream: a token span of ", chunk.num_tokens(),
        " tokens has ", chunk.data().size(), " bytes, expected ", expected));
  }
  *outcome = KvTransferOutcome::kInternal;
  absl::Status written =
      staging.Scatter(chunk.data(), *p.view, *p.destination,
                      chunk.first_token(), chunk.num_tokens());
  if (!written.ok()) return written;
  next_token += chunk.num_tokens();
  return absl::OkStatus();
}

}  // namespace

KvChunkReader::KvChunkReader(grpc::Channel& channel,
                             grpc::ClientContext* context,
                             const v1::PullKvRequest& request)
    : context_(context),
      reader_(grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          &channel,
          grpc::internal::RpcMethod(
              "/pdworker.v1.KvTransfer/PullKv",
              grpc::internal::RpcMethod::SERVER_STREAMING),
          context, request)) {}

KvChunkReader::Next KvChunkReader::Read(v1::KvChunk* chunk) {
  grpc::ByteBuffer bytes;
  if (!reader_->Read(&bytes)) return Next::kEnd;
  // Parsed from the received slices in place: a chunk's bytes are copied
  // once, into chunk->data.
  grpc::ProtoBufferReader in(&bytes);
  const bool parsed = chunk->ParseFromZeroCopyStream(&in) && in.status().ok();
  if (parsed) return Next::kChunk;
  context_->TryCancel();  // Finish() returns CANCELLED now
  return Next::kMalformed;
}

v1::PullKvRequest PullRequestFor(const KvPullParams& p,
                                 absl::string_view transport) {
  v1::PullKvRequest request;
  request.set_lease_id(p.handle->lease_id());
  request.set_model_fingerprint(p.model_fingerprint);
  *request.mutable_layout() = ToProto(p.view->layout);
  request.set_transport(std::string(transport));
  request.set_num_tokens(p.handle->num_tokens());
  request.set_source_epoch(p.handle->source_epoch());
  request.set_first_token(p.first_token);
  request.mutable_prompt_token_ids()->Add(p.token_ids.begin(),
                                          p.token_ids.end());
  return request;
}

absl::Status ClassifyPullEnd(const KvPullParams& p,
                             const grpc::Status& finished, bool complete,
                             int64_t bytes, KvTransferOutcome* outcome) {
  const std::string& source = p.handle->source_address();
  if (finished.ok()) {
    if (!complete) {
      *outcome = KvTransferOutcome::kMalformedStream;
      return absl::InternalError(absl::StrCat(
          "KV stream from ", source, " ended before all of the lease's KV"));
    }
    *outcome = KvTransferOutcome::kOk;
    return absl::OkStatus();
  }
  const std::string what =
      absl::StrCat("KV pull from prefill worker ", source, " (lease ",
                   p.handle->lease_id(), ") after ", bytes, " bytes: ");
  switch (finished.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
      *outcome = SaysLeaseExpired(finished.error_message())
                     ? KvTransferOutcome::kLeaseExpired
                     : KvTransferOutcome::kLeaseNotFound;
      break;
    case grpc::StatusCode::FAILED_PRECONDITION:
      // The source's refusals (see KvTransferService / CheckCompatible).
      if (absl::StrContains(finished.error_message(), "fingerprint") ||
          absl::StrContains(finished.error_message(), "KV layout")) {
        *outcome = KvTransferOutcome::kModelMismatch;
      } else if (absl::StrContains(finished.error_message(), "num_tokens") ||
                 absl::StrContains(finished.error_message(),
                                   "prompt_token_ids")) {
        *outcome = KvTransferOutcome::kHandleMismatch;
      } else {
        *outcome = KvTransferOutcome::kAlreadyPulled;
      }
      break;
    case grpc::StatusCode::INVALID_ARGUMENT:
      *outcome = KvTransferOutcome::kInternal;
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      if (std::chrono::system_clock::now() >= p.call_deadline) {
        *outcome = KvTransferOutcome::kDeadline;
        return absl::DeadlineExceededError(
            absl::StrCat(what, "the ImportKv deadline passed"));
      }
      *outcome = bytes == 0 ? KvTransferOutcome::kSourceUnreachable
                            : KvTransferOutcome::kTransportError;
      return absl::UnavailableError(
          absl::StrCat(what, "no answer within the pull timeout"));
    default:
      // Nothing came: the source is down or cut off; something came and
      // the stream broke: a transport error.
      *outcome =
          bytes == 0 && finished.error_code() == grpc::StatusCode::UNAVAILABLE
              ? KvTransferOutcome::kSourceUnreachable
              : KvTransferOutcome::kTransportError;
      return absl::UnavailableError(
          absl::StrCat(what, "source failed (", finished.error_code(),
                       "): ", finished.error_message()));
  }
  return absl::Status(FromGrpcStatus(finished).code(),
                      absl::StrCat(what, finished.error_message()));
}

absl::Status PullKvOverGrpc(PeerChannels& channels, const KvPullParams& p,
                            KvPullStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  const std::string& source = p.handle->source_address();
  // Layer runs are written into the destination blocks on p.stream; on
  // every path out, those writes have run before the caller may free them.
  StreamFence written(*p.stream);
  grpc::ClientContext context;
  context.set_deadline(std::min(p.call_deadline, p.pull_deadline));
  v1::PullKvRequest request = PullRequestFor(p, "grpc");
  KvSpanStagingPool::Lease staging;
  if (p.span_stagings != nullptr) {
    absl::StatusOr<KvSpanStagingPool::Lease> got = p.span_stagings->Acquire();
    if (got.ok()) {
      staging = *std::move(got);
      request.set_chunk_layout(v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
    } else {
      LOG(WARNING) << "KV pull in layer runs (no token-span staging: "
                   << got.status() << ")";
    }
  }

  int64_t bytes = 0;
  Cursor cursor;  // layer runs
  cursor.next_token = p.first_token;
  int32_t span_next = p.first_token;  // token spans
  // What the first chunk was; a source whose first chunk is a layer run
  // predates token spans (it ignored chunk_layout). Never mixed.
  std::optional<v1::KvChunkLayout> layout;
  absl::Status applied = absl::OkStatus();
  KvTransferOutcome outcome = KvTransferOutcome::kOk;
  KvChunkReader reader(*channels.Get(source), &context, request);
  v1::KvChunk chunk;
  for (;;) {
    const KvChunkReader::Next next = reader.Read(&chunk);
    if (next == KvChunkReader::Next::kEnd) break;
    if (next == KvChunkReader::Next::kMalformed) {
      outcome = KvTransferOutcome::kMalformedStream;
      applied = absl::InternalError(absl::StrCat(
          "malformed KV stream from ", source,
          ": a message that is not a KvChunk, after ", bytes, " bytes"));
      break;
    }
    bytes += static_cast<int64_t>(chunk.data().size());
    if (!layout.has_value()) layout = chunk.chunk_layout();
    if (chunk.chunk_layout() != *layout ||
        (*layout == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN && staging == nullptr) ||
        (*layout != v1::KV_CHUNK_LAYOUT_TOKEN_SPAN &&
         *layout != v1::KV_CHUNK_LAYOUT_LAYER_RUN)) {
      outcome = KvTransferOutcome::kMalformedStream;
      applied = absl::InternalError(absl::StrCat(
          "malformed KV stream from ", source, ": a chunk of layout ",
          chunk.chunk_layout(), " in a stream of layout ", *layout,
          staging == nullptr ? " (layer runs were asked for)" : ""));
    } else if (*layout == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN) {
      applied = ApplySpanChunk(p, chunk, span_next, *staging, &outcome);
    } else {
      applied = ApplyChunk(p, chunk, cursor, &outcome);
    }
    if (!applied.ok()) {
      context.TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader.Finish();
  // Nothing may still write the reserved blocks when this returns: on an
  // error the importer frees them.
  const absl::Status scattered =
      staging != nullptr ? staging->Synchronize() : absl::OkStatus();
  absl::Status result = applied;
  if (result.ok()) {
    const bool complete = layout == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN
                              ? span_next == p.handle->num_tokens()
                              : cursor.layer == p.view->layout.num_layers;
    result = ClassifyPullEnd(p, finished, complete, bytes, &outcome);
  }
  if (result.ok()) {
    // Ordered before the engine's next step reads these blocks.
    result = scattered;
    if (result.ok()) result = written.Wait();
    if (!result.ok()) outcome = KvTransferOutcome::kInternal;
  }
  RecordPullStats(stats, start, bytes, outcome);
  return result;
}

void RecordPullStats(KvPullStats* stats,
                     std::chrono::steady_clock::time_point start, int64_t bytes,
                     KvTransferOutcome outcome) {
  if (stats == nullptr) return;
  stats->bytes = bytes;
  stats->seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  stats->outcome = outcome;
}

}  // namespace pdworker
