#include "worker/transfer/kv_transfer_service.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpc/slice.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "glog/logging.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/rpc/parsed_call.h"
#include "worker/rpc/status_mapping.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {

// Runs NCCL sends one after another on its own thread: joining a
// communicator and sending block for up to the puller's deadline, which no
// gRPC callback thread may do. Jobs still queued at destruction run first
// (each is bounded by its deadline, and aborted early once the
// communicator cache shuts down), so every pull gets its answer.
class NcclSender {
 public:
  NcclSender() : thread_([this] { Run(); }) {}
  ~NcclSender() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

namespace {

// The first position where a puller's token ids disagree with the lease's
// (a different count counts as position min(sizes)); -1 when they agree or
// either side does not know them (no ids sent; prefix caching off here, or
// ids unknown at that position).
int32_t FirstDifference(absl::Span<const int32_t> ids, const SequenceKv& kv) {
  if (ids.empty()) return -1;
  if (static_cast<int32_t>(ids.size()) != kv.num_tokens) {
    return std::min(static_cast<int32_t>(ids.size()), kv.num_tokens);
  }
  if (static_cast<int32_t>(kv.token_ids.size()) != kv.num_tokens) return -1;
  for (int32_t i = 0; i < kv.num_tokens; ++i) {
    if (kv.token_ids[i] != kUnknownTokenId && kv.token_ids[i] != ids[i]) {
      return i;
    }
  }
  return -1;
}

// A KV_CHUNK_LAYOUT_TOKEN_SPAN chunk of tokens [first_token, first_token +
// num_tokens) carrying `size` bytes of `data`, serialized by hand so that
// the bytes are copied once, from the pinned staging into the message's
// slice (protobuf would copy them into the message, then into the slice).
grpc::ByteBuffer SerializeSpanChunk(int32_t first_token, int32_t num_tokens,
                                    const char* data, size_t size) {
  using google::protobuf::internal::WireFormatLite;
  using google::protobuf::io::CodedOutputStream;
  v1::KvChunk header;
  header.set_first_token(first_token);
  header.set_num_tokens(num_tokens);
  header.set_chunk_layout(v1::KV_CHUNK_LAYOUT_TOKEN_SPAN);
  const size_t header_size = header.ByteSizeLong();
  const uint32_t data_tag = WireFormatLite::MakeTag(
      v1::KvChunk::kDataFieldNumber, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  const size_t total = header_size + CodedOutputStream::VarintSize32(data_tag) +
                       CodedOutputStream::VarintSize64(size) + size;
  grpc_slice slice = grpc_slice_malloc(total);
  uint8_t* out = GRPC_SLICE_START_PTR(slice);
  out = header.SerializeWithCachedSizesToArray(out);
  out = CodedOutputStream::WriteTagToArray(data_tag, out);
  out = CodedOutputStream::WriteVarint64ToArray(size, out);
  std::memcpy(out, data, size);
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

// One PullKv stream. Walks (layer, K then V, token runs), or token spans of
// every layer, and writes one chunk at a time; gRPC deletes it in OnDone,
// which ends the pull.
class PullReactor final : public MessageWriter {
 public:
  PullReactor(KvLeaseTable& leases, Device& device, const KvCacheView& view,
              size_t max_chunk_bytes, WorkerMetrics* metrics)
      : leases_(leases),
        device_(device),
        view_(view),
        metrics_(metrics),
        start_(std::chrono::steady_clock::now()) {
    // Whole blocks per chunk, at least one.
    const size_t block_bytes = view.token_bytes * view.block_size;
    tokens_per_chunk_ =
        view.block_size *
        static_cast<int32_t>(std::max<size_t>(
            1, max_chunk_bytes / std::max<size_t>(1, block_bytes)));
  }

  void Refuse(const absl::Status& status,
              KvTransferOutcome outcome = KvTransferOutcome::kInternal) {
    outcome_ = outcome;
    Finish(ToGrpcStatus(status));
  }

  // Serve the lease in token spans staged through `pool`'s buffers.
  void UseTokenSpans(KvSpanStagingPool* pool) { span_pool_ = pool; }
  // Serve the lease as one CUDA IPC export instead of its bytes.
  void UseCudaIpc(const std::string& handle) { ipc_handle_ = handle; }
  // Serve the lease over NCCL through `comm` (rank 1), sending on `sender`;
  // `kept`: the communicator outlives this pull (the ready chunk says so).
  void UseNccl(NcclCommCache::Lease comm, bool kept, NcclSender* sender,
               std::chrono::steady_clock::time_point deadline) {
    nccl_comm_.emplace(std::move(comm));
    nccl_kept_ = kept;
    nccl_sender_ = sender;
    nccl_deadline_ = deadline;
  }

  // Starts the pull, or finishes at once with the reason it is refused.
  // `expected_tokens`: the puller's handle's num_tokens (0: not checked);
  // tokens from `first_token` on are sent (the puller has the rest);
  // `token_ids`: the handle's prompt ids (empty: not checked).
  void Start(const absl::Status& compatible, const std::string& lease_id,
             int32_t expected_tokens, int32_t first_token,
             absl::Span<const int32_t> token_ids) {
    if (!compatible.ok()) {
      outcome_ = KvTransferOutcome::kModelMismatch;
      Finish(ToGrpcStatus(compatible));
      return;
    }
    absl::StatusOr<KvPullGrant> grant = leases_.BeginPull(lease_id);
    if (!grant.ok()) {
      outcome_ = grant.status().code() != absl::StatusCode::kNotFound
                     ? KvTransferOutcome::kAlreadyPulled
                 : SaysLeaseExpired(grant.status().message())
                     ? KvTransferOutcome::kLeaseExpired
                     : KvTransferOutcome::kLeaseNotFound;
      Finish(ToGrpcStatus(grant.status()));
      return;
    }
    if (expected_tokens > 0 && expected_tokens != grant->kv.num_tokens) {
      // Put the lease back: the right handle may still pull it.
      leases_.EndPull(lease_id, /*sent_all=*/false);
      outcome_ = KvTransferOutcome::kHandleMismatch;
      Finish(ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "the KV handle's num_tokens is ", expected_tokens, " but lease ",
          lease_id, " holds ", grant->kv.num_tokens,
          " tokens: the handle was altered or belongs to another lease"))));
      return;
    }
    if (const int32_t differs = FirstDifference(token_ids, grant->kv);
        differs >= 0) {
      // The puller would cache our K/V under other tokens' hashes.
      leases_.EndPull(lease_id, /*sent_all=*/false);
      outcome_ = KvTransferOutcome::kHandleMismatch;
      Finish(ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "the KV handle's prompt_token_ids (", token_ids.size(),
          ") are not the tokens lease ", lease_id, " holds (",
          grant->kv.num_tokens, "; first difference at token ", differs,
          "): the handle was altered or belongs to another lease"))));
      return;
    }
    if (first_token < 0 || first_token >= grant->kv.num_tokens) {
      leases_.EndPull(lease_id, /*sent_all=*/false);
      outcome_ = KvTransferOutcome::kHandleMismatch;
      Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "first_token=", first_token, " outside [0, ", grant->kv.num_tokens,
          "): lease ", lease_id, " holds ", grant->kv.num_tokens, " tokens"))));
      return;
    }
    lease_id_ = lease_id;
    first_token_ = first_token;
    next_token_ = first_token;
    grant_ = std::move(*grant);
    if (span_pool_ != nullptr) {
      StartSpans();
      return;
    }
    if (!ipc_handle_.empty()) {
      WriteIpcExport();
      return;
    }
    if (nccl_comm_.has_value()) {
      nccl_ready_sent_ = true;
      chunk_.set_nccl_ready(true);
      chunk_.set_nccl_comm_kept(nccl_kept_);
      StartWriteMessage(chunk_);
      return;
    }
    // Layer runs read through a stream of their own (the export needs
    // none, NCCL makes its own, token spans use their staging's).
    absl::StatusOr<std::unique_ptr<Stream>> stream = device_.CreateStream();
    if (!stream.ok()) {
      outcome_ = KvTransferOutcome::kInternal;
      FinishPull(stream.status());
      return;
    }
    stream_ = std::move(*stream);
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    if (ok && ipc_export_sent_) {
      FinishPull(absl::OkStatus());  // sent_all_ stays false: still pullable
      return;
    }
    if (ok && nccl_ready_sent_) {
      nccl_sender_->Submit([this] { SendOverNccl(); });
      return;
    }
    if (!ok) {  // the puller went away (cancelled, deadline, connection)
      if (nccl_comm_.has_value()) nccl_comm_->Drop();
      outcome_ = KvTransferOutcome::kCancelled;
      FinishPull(absl::CancelledError("the puller went away mid-stream"));
      return;
    }
    if (staging_ != nullptr) {
      bytes_ += view_.BytesFor(written_span_tokens_);
      WriteSpan();
      return;
    }
    bytes_ += static_cast<int64_t>(chunk_.data().size());
    NextWrite();
  }

  void OnDone() override {
    if (!lease_id_.empty()) leases_.EndPull(lease_id_, sent_all_);
    if (metrics_ != nullptr) {
      metrics_->ObserveKvTransfer(KvTransport::kGrpc,
                                  KvTransferDirection::kSend, outcome_, bytes_,
                                  std::chrono::duration<double>(
                                      std::chrono::steady_clock::now() - start_)
                                      .count());
    }
    delete this;
  }

 private:
  void NextWrite() {
    const int32_t n = grant_.kv.num_tokens;
    if (layer_ == view_.layout.num_layers) {
      sent_all_ = true;
      FinishPull(absl::OkStatus());
      return;
    }
    // Chunks end on multiples of tokens_per_chunk_ (whole source blocks);
    // only a part's first chunk may start inside a block (first_token_).
    const int32_t chunk_end =
        (next_token_ / tokens_per_chunk_ + 1) * tokens_per_chunk_;
    KvTokenRun run{layer_, part_, next_token_,
                   std::min(chunk_end, n) - next_token_};
    chunk_.Clear();
    chunk_.set_layer(run.layer);
    chunk_.set_part(run.part == KvCachePart::kKey ? v1::KvChunk::PART_KEY
                                                  : v1::KvChunk::PART_VALUE);
    chunk_.set_first_token(run.first_token);
    chunk_.set_num_tokens(run.num_tokens);
    std::string* data = chunk_.mutable_data();
    data->resize(static_cast<size_t>(run.num_tokens) * view_.token_bytes);
    const absl::Status read =
        ReadKvTokens(*stream_, view_, grant_.kv, run, data->data());
    if (!read.ok()) {
      outcome_ = KvTransferOutcome::kInternal;
      FinishPull(
          absl::InternalError(absl::StrCat("reading KV: ", read.message())));
      return;
    }
    // Advance the cursor: tokens, then V after K, then the next layer.
    next_token_ += run.num_tokens;
    if (next_token_ == n) {
      next_token_ = first_token_;
      if (part_ == KvCachePart::kKey) {
        part_ = KvCachePart::kValue;
      } else {
        part_ = KvCachePart::kKey;
        ++layer_;
      }
    }
    StartWriteMessage(chunk_);
  }

  void StartSpans() {
    absl::StatusOr<KvSpanStagingPool::Lease> staging = span_pool_->Acquire();
    if (!staging.ok()) {
      outcome_ = KvTransferOutcome::kInternal;
      FinishPull(staging.status());
      return;
    }
    staging_ = *std::move(staging);
    span_tokens_ = span_pool_->span_tokens();
    next_token_ = first_token_;
    if (GatherSpan()) WriteSpan();
  }

  // Enqueues the gather of the span after the last one; false (the pull
  // finished with the error) when it could not.
  bool GatherSpan() {
    gathered_first_ = next_token_;
    gathered_tokens_ =
        std::min(span_tokens_, grant_.kv.num_tokens - next_token_);
    const absl::Status gathered =
        staging_->Gather(view_, grant_.kv, gathered_first_, gathered_tokens_);
    if (!gathered.ok()) {
      outcome_ = KvTransferOutcome::kInternal;
      FinishPull(absl::InternalError(
          absl::StrCat("reading KV: ", gathered.message())));
      return false;
    }
    next_token_ += gathered_tokens_;
    return true;
  }

  // Writes the gathered span and gathers the next one while it goes out.
  void WriteSpan() {
    if (gathered_tokens_ == 0) {
      sent_all_ = true;
      FinishPull(absl::OkStatus());
      return;
    }
    absl::StatusOr<const char*> bytes = staging_->Gathered();
    if (!bytes.ok()) {
      outcome_ = KvTransferOutcome::kInternal;
      FinishPull(absl::InternalError(
          absl::StrCat("reading KV: ", bytes.status().message())));
      return;
    }
    grpc::ByteBuffer chunk = SerializeSpanChunk(
        gathered_first_, gathered_tokens_, *bytes,
        static_cast<size_t>(view_.BytesFor(gathered_tokens_)));
    written_span_tokens_ = gathered_tokens_;
    gathered_tokens_ = 0;
    if (next_token_ < grant_.kv.num_tokens && !GatherSpan()) return;
    StartWriteBytes(std::move(chunk));
  }

  // One chunk saying where the lease lives. The lease stays pullable (see
  // PullKvRequest.transport): the puller releases it after copying.
  void WriteIpcExport() {
    ipc_export_sent_ = true;
    v1::CudaIpcExport* e = chunk_.mutable_cuda_ipc();
    e->set_mem_handle(ipc_handle_);
    e->set_allocation_bytes(
        static_cast<int64_t>(view_.allocation.size_bytes()));
    const char* base = static_cast<const char*>(view_.allocation.data());
    for (int l = 0; l < view_.layout.num_layers; ++l) {
      e->add_key_offsets(static_cast<const char*>(view_.keys[l].data()) - base);
      e->add_value_offsets(static_cast<const char*>(view_.values[l].data()) -
                           base);
    }
    e->set_cache_bytes_per_layer(static_cast<int64_t>(
        view_.keys.empty() ? 0 : view_.keys[0].size_bytes()));
    e->set_block_size(view_.block_size);
    for (const int32_t b : grant_.kv.blocks) e->add_blocks(b);
    e->set_num_tokens(grant_.kv.num_tokens);
    StartWriteMessage(chunk_);
  }

  // On the NcclSender's thread; the last use of `this` is Finish.
  void SendOverNccl() {
    NcclKvParams params;
    params.device = &device_;
    params.view = &view_;
    params.seq = &grant_.kv;
    params.first_token = first_token_;
    params.num_tokens = grant_.kv.num_tokens;
    params.deadline = nccl_deadline_;
    const absl::Status sent = NcclSendKv(params, *nccl_comm_);
    // Released before the stream ends: the puller's next pull over the pair
    // starts after our end of stream and finds it free.
    nccl_comm_.reset();
    if (sent.ok()) {
      sent_all_ = true;
      bytes_ = view_.BytesFor(grant_.kv.num_tokens - first_token_);
    } else {
      outcome_ = sent.code() == absl::StatusCode::kUnavailable
                     ? KvTransferOutcome::kCancelled
                     : KvTransferOutcome::kInternal;
    }
    FinishPull(sent);
  }

  void FinishPull(const absl::Status& status) {
    if (!status.ok()) {
      LOG(WARNING) << "KV pull of lease " << lease_id_ << " failed after "
                   << bytes_ << " bytes: " << status;
    }
    // A complete pull ends its lease before the puller hears OK: a
    // ReleaseKv sent right after the stream (the decode worker's, after its
    // import) then frees the blocks at once and reports them, instead of
    // finding the lease still being pulled (freed later at OnDone, reported
    // as 0 freed). Everything was sent; nothing reads the blocks any more.
    if (status.ok() && sent_all_ && !lease_id_.empty()) {
      leases_.EndPull(lease_id_, /*sent_all=*/true);
      lease_id_.clear();  // OnDone must not end it twice
    }
    Finish(ToGrpcStatus(status));
  }

  KvLeaseTable& leases_;
  Device& device_;
  const KvCacheView& view_;
  WorkerMetrics* const metrics_;
  const std::chrono::steady_clock::time_point start_;
  int32_t tokens_per_chunk_ = 0;

  std::string lease_id_;  // set once BeginPull succeeded
  KvPullGrant grant_;
  std::unique_ptr<Stream> stream_;
  v1::KvChunk chunk_;
  int layer_ = 0;
  KvCachePart part_ = KvCachePart::kKey;
  int32_t first_token_ = 0;  // PullKvRequest.first_token
  int32_t next_token_ = 0;
  int64_t bytes_ = 0;
  bool sent_all_ = false;
  KvTransferOutcome outcome_ = KvTransferOutcome::kOk;
  std::string ipc_handle_;  // non-empty: serve a CUDA IPC export
  bool ipc_export_sent_ = false;
  std::optional<NcclCommCache::Lease> nccl_comm_;  // set: serve over NCCL
  bool nccl_kept_ = false;
  NcclSender* nccl_sender_ = nullptr;
  std::chrono::steady_clock::time_point nccl_deadline_;
  bool nccl_ready_sent_ = false;
  // Token spans: the pool and, once granted, the staging; the span gathered
  // (0 tokens: none left) and the one being written.
  KvSpanStagingPool* span_pool_ = nullptr;
  KvSpanStagingPool::Lease staging_;
  int32_t span_tokens_ = 0;
  int32_t gathered_first_ = 0;
  int32_t gathered_tokens_ = 0;
  int32_t written_span_tokens_ = 0;
};

}  // namespace

v1::KvLayout ToProto(const KvLayoutInfo& layout) {
  v1::KvLayout out;
  out.set_num_layers(layout.num_layers);
  out.set_num_kv_heads(layout.num_kv_heads);
  out.set_head_dim(layout.head_dim);
  out.set_dtype(layout.dtype);
  return out;
}

KvLayoutInfo FromProto(const v1::KvLayout& layout) {
  return KvLayoutInfo{layout.num_layers(), layout.num_kv_heads(),
                      layout.head_dim(), layout.dtype()};
}

absl::Status CheckCompatible(absl::string_view what,
                             const std::string& their_fingerprint,
                             const KvLayoutInfo& their_layout,
                             const std::string& our_fingerprint,
                             const KvLayoutInfo& our_layout) {
  if (their_fingerprint != our_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " is for model fingerprint '", their_fingerprint,
        "', this worker serves '", our_fingerprint,
        "': KV caches of different models are not interchangeable"));
  }
  if (!(their_layout == our_layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " has KV layout ", their_layout.ToString(),
                     ", this worker's is ", our_layout.ToString()));
  }
  return absl::OkStatus();
}

KvTransferService::KvTransferService(KvLeaseTable& leases, Device& device,
                                     KvCacheView view,
                                     std::string model_fingerprint,
                                     const KvTransferServiceOptions& options,
                                     WorkerMetrics* metrics,
                                     NcclCommCache* nccl_comms)
    : leases_(leases),
      device_(device),
      view_(std::move(view)),
      fingerprint_(std::move(model_fingerprint)),
      options_(options),
      metrics_(metrics),
      nccl_comms_(nccl_comms),
      epoch_(RandomHexId()),
      span_stagings_(device, view_, options.max_chunk_bytes,
                     options.max_idle_span_stagings) {
  if (nccl_comms_ != nullptr) nccl_sender_ = std::make_unique<NcclSender>();
  if (device.kind() == DeviceKind::kCuda && !view_.allocation.empty()) {
    absl::StatusOr<std::string> handle = ExportCudaIpcHandle(view_.allocation);
    if (handle.ok()) {
      ipc_handle_ = *std::move(handle);
    } else {
      LOG(WARNING) << "KV handoff without CUDA IPC: " << handle.status();
    }
  }
}

KvTransferService::~KvTransferService() = default;

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvTransferService::PullKv(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  v1::PullKvRequest parsed_request;
  if (grpc::Status parsed = ParseRequest(*raw_request, &parsed_request);
      !parsed.ok()) {
    return new ListWriter({}, parsed);
  }
  const v1::PullKvRequest* request = &parsed_request;
  auto* reactor = new PullReactor(leases_, device_, view_,
                                  options_.max_chunk_bytes, metrics_);
  absl::Status allowed =
      CheckCompatible("the pull", request->model_fingerprint(),
                      FromProto(request->layout()), fingerprint_, view_.layout);
  if (allowed.ok() && !request->source_epoch().empty() &&
      request->source_epoch() != epoch_) {
    // The lease id may even exist here by chance; its KV is not the one the
    // handle was issued for.
    reactor->Refuse(
        absl::FailedPreconditionError(absl::StrCat(
            "this worker restarted since the KV handle was issued (handle "
            "epoch ",
            request->source_epoch(), ", now ", epoch_,
            "): its leases are gone; prefill the prompt again")),
        KvTransferOutcome::kHandleMismatch);
    return reactor;
  }
  const std::string& transport = request->transport();
  const v1::KvChunkLayout chunk_layout = request->chunk_layout();
  if (allowed.ok() && !v1::KvChunkLayout_IsValid(chunk_layout)) {
    reactor->Refuse(
        absl::InvalidArgumentError(absl::StrCat(
            "chunk_layout=", chunk_layout,
            " is not a KvChunkLayout this worker knows (0: LAYER_RUN, 1: "
            "TOKEN_SPAN)")),
        KvTransferOutcome::kHandleMismatch);
    return reactor;
  }
  if (allowed.ok() && chunk_layout != v1::KV_CHUNK_LAYOUT_LAYER_RUN &&
      !transport.empty() && transport != "grpc") {
    reactor->Refuse(
        absl::InvalidArgumentError(absl::StrCat(
            "chunk_layout=", v1::KvChunkLayout_Name(chunk_layout),
            " with transport '", transport,
            "': only the gRPC stream (transport \"grpc\") has chunks")),
        KvTransferOutcome::kHandleMismatch);
    return reactor;
  }
  if (allowed.ok() && !transport.empty() && transport != "grpc" &&
      !(transport == "cuda_ipc" && offers_cuda_ipc()) &&
      !(transport == "nccl" && offers_nccl())) {
    reactor->Refuse(absl::UnimplementedError(
        absl::StrCat("this worker offers no KV transport '", transport, "'")));
    return reactor;
  }
  if (chunk_layout == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN) {
    reactor->UseTokenSpans(&span_stagings_);
  }
  if (transport == "cuda_ipc") reactor->UseCudaIpc(ipc_handle_);
  if (allowed.ok() && transport == "nccl") {
    // Before the lease is granted: a puller told to make a new communicator
    // (ABORTED) or to use the stream (RESOURCE_EXHAUSTED) can still pull.
    absl::StatusOr<NcclCommCache::Lease> comm = nccl_comms_->Open(
        request->nccl_puller_id(), request->nccl_comm_generation(),
        request->nccl_unique_id());
    if (!comm.ok()) {
      reactor->Refuse(comm.status().code() == absl::StatusCode::kNotFound
                          ? absl::AbortedError(comm.status().message())
                          : comm.status());
      return reactor;
    }
    // The puller's deadline bounds the join and the send; none: a minute.
    const auto now = std::chrono::system_clock::now();
    const auto left = std::min<std::chrono::system_clock::duration>(
        context->deadline() - now, std::chrono::seconds(60));
    reactor->UseNccl(*std::move(comm),
                     /*kept=*/!request->nccl_puller_id().empty(),
                     nccl_sender_.get(),
                     std::chrono::steady_clock::now() + left);
  }
  reactor->Start(allowed, request->lease_id(), request->num_tokens(),
                 request->first_token(),
                 absl::MakeConstSpan(request->prompt_token_ids().data(),
                                     request->prompt_token_ids_size()));
  return reactor;
}

grpc::ServerUnaryReactor* KvTransferService::ReleaseKv(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<v1::ReleaseKvRequest, v1::ReleaseKvResponse>(
      context, raw_request, raw_response,
      [this](const v1::ReleaseKvRequest& request,
             v1::ReleaseKvResponse* response) {
        absl::StatusOr<int32_t> freed = leases_.Release(request.lease_id());
        if (freed.ok()) response->set_freed_blocks(*freed);
        return ToGrpcStatus(freed.status());
      });
}

grpc::ServerUnaryReactor* KvTransferService::RenewKv(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return AnswerNow<v1::RenewKvRequest, v1::RenewKvResponse>(
      context, raw_request, raw_response,
      [this](const v1::RenewKvRequest& request, v1::RenewKvResponse* response) {
        absl::StatusOr<std::chrono::system_clock::time_point> expiry =
            leases_.Renew(request.lease_id());
        if (expiry.ok()) {
          response->set_lease_expiry_unix_micros(
              std::chrono::duration_cast<std::chrono::microseconds>(
                  expiry->time_since_epoch())
                  .count());
        }
        return ToGrpcStatus(expiry.status());
      });
}

}  // namespace pdworker
