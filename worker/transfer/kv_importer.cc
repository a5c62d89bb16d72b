#include "worker/transfer/kv_importer.h"

#include <algorithm>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "glog/logging.h"
#include "proto/worker.grpc.pb.h"
#include "worker/engine/kv_lease_table.h"
#include "worker/transfer/cuda_ipc_puller.h"
#include "worker/transfer/grpc_kv_puller.h"
#include "worker/transfer/kv_transfer_service.h"
#include "worker/transfer/nccl_kv_puller.h"

namespace pdworker {

absl::Status ValidateKvHandle(const v1::KvHandle& handle,
                              const std::string& model_fingerprint,
                              const KvLayoutInfo& layout, int max_model_len) {
  if (handle.source_address().empty()) {
    return absl::InvalidArgumentError("handle.source_address is empty");
  }
  if (handle.lease_id().empty()) {
    return absl::InvalidArgumentError("handle.lease_id is empty");
  }
  if (handle.num_tokens() <= 0 || handle.num_tokens() > max_model_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("handle.num_tokens=", handle.num_tokens(),
                     " outside [1, max_model_len=", max_model_len, "]"));
  }
  return CheckCompatible("the KV handle", handle.model_fingerprint(),
                         FromProto(handle.layout()), model_fingerprint, layout);
}

KvImporter::KvImporter(Engine& engine, Device& device, KvCacheView view,
                       std::string model_fingerprint, PeerChannels& peers,
                       const KvImporterOptions& options, WorkerMetrics* metrics,
                       NcclCommCache* nccl_comms)
    : engine_(engine),
      device_(device),
      view_(std::move(view)),
      fingerprint_(std::move(model_fingerprint)),
      peers_(peers),
      options_(options),
      metrics_(metrics),
      host_id_(HostId()),
      nccl_comms_(nccl_comms),
      nccl_puller_id_(RandomHexId()),
      span_stagings_(device, view_, options.span_staging_bytes,
                     options.num_threads) {
  CHECK_GT(options.num_threads, 0);
  for (int i = 0; i < options.num_threads; ++i) {
    threads_.emplace_back([this] { Work(); });
  }
  if (options.renew_margin.count() > 0) {
    renewer_ = std::thread([this] { RenewLeases(); });
  }
}

KvImporter::~KvImporter() {
  std::deque<Job> refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    refused.swap(queue_);
  }
  cv_.notify_all();
  renew_cv_.notify_all();
  for (Job& job : refused) {
    job.done(absl::UnavailableError("the worker is shutting down"));
  }
  for (std::thread& t : threads_) t.join();
  if (renewer_.joinable()) renewer_.join();
}

void KvImporter::Import(KvImportRequest request, Done done) {
  absl::Status refused = absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refused = absl::UnavailableError("the worker is shutting down");
    } else if (static_cast<int64_t>(queue_.size()) >= options_.max_pending) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("too many KV imports queued (", queue_.size(), ")"));
    } else if (importing_.contains(request.sequence_id)) {
      refused = absl::AlreadyExistsError(absl::StrCat(
          "sequence '", request.sequence_id, "' is being imported already"));
    }
    if (refused.ok()) {
      importing_.insert(request.sequence_id);
      renewing_[request.sequence_id] = RenewedLease{
          request.handle.source_address(), request.handle.lease_id(),
          std::chrono::system_clock::time_point(std::chrono::microseconds(
              request.handle.lease_expiry_unix_micros()))};
      ++in_flight_;
      queue_.push_back(Job{std::move(request), std::move(done),
                           std::chrono::system_clock::now()});
    }
  }
  if (refused.ok()) {
    cv_.notify_one();
  } else {
    // Moved only when queued (refused.ok()), so still ours here.
    done(refused);  // NOLINT(bugprone-use-after-move)
  }
}

int64_t KvImporter::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

void KvImporter::Work() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::StatusOr<KvImportResult> result = RunJob(job);
    {
      std::lock_guard<std::mutex> lock(mu_);
      importing_.erase(job.request.sequence_id);
      renewing_.erase(job.request.sequence_id);
      --in_flight_;
    }
    job.done(result);
    // After answering: the sequence is usable now; the release only frees
    // the source's blocks early.
    if (result.ok()) ReleaseLease(job.request.handle);
  }
}

absl::StatusOr<KvReservation> KvImporter::Reserve(
    const Job& job, absl::Span<const int32_t> token_ids) {
  const KvImportRequest& request = job.request;
  auto call = std::make_unique<KvReservationCall>();
  call->sequence_id = request.sequence_id;
  call->num_tokens = request.handle.num_tokens();
  call->token_ids.assign(token_ids.begin(), token_ids.end());
  call->imported_as = request.imported_as;
  call->control = request.control;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = renewing_.find(request.sequence_id);
    if (it != renewing_.end()) call->source_gone = it->second.lost;
  }
  if (call->control == nullptr) {
    call->control = std::make_shared<CallControl>();
    call->control->deadline = request.deadline;
  }
  // A lease nobody renews is gone at its expiry: waiting past it is for
  // nothing.
  call->wait_deadline = job.arrival + options_.wait_timeout;
  const auto lease_expiry = std::chrono::system_clock::time_point(
      std::chrono::microseconds(request.handle.lease_expiry_unix_micros()));
  const bool lease_bounds_wait =
      options_.renew_margin.count() == 0 &&
      request.handle.lease_expiry_unix_micros() > 0 &&
      lease_expiry < call->wait_deadline;
  if (lease_bounds_wait) call->wait_deadline = lease_expiry;
  // Shared with the callback, which may still be returning from set_value
  // when this thread wakes up.
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<KvReservation>>>();
  std::future<absl::StatusOr<KvReservation>> reserved = promise->get_future();
  call->done = [promise](absl::StatusOr<KvReservation> result) {
    promise->set_value(std::move(result));
  };
  engine_.Submit(std::move(call));
  absl::StatusOr<KvReservation> result = reserved.get();
  if (absl::IsNotFound(result.status())) {
    return absl::NotFoundError(absl::StrCat(
        "lease ", request.handle.lease_id(), " on ",
        request.handle.source_address(),
        " expired or was released while the import waited for KV room; "
        "nothing was reserved or pulled"));
  }
  if (absl::IsResourceExhausted(result.status())) {
    if (lease_bounds_wait) {
      return absl::NotFoundError(
          absl::StrCat("lease ", request.handle.lease_id(), " on ",
                       request.handle.source_address(),
                       " expired while the import waited for KV room (",
                       result.status().message(), ")"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: ", result.status().message(),
        " (--kv_import_wait_timeout=", options_.wait_timeout.count(), "ms)"));
  }
  return result;
}

absl::StatusOr<KvImportResult> KvImporter::RunJob(const Job& job) {
  const KvImportRequest& request = job.request;
  const auto start = std::chrono::steady_clock::now();
  if (std::chrono::system_clock::now() >= request.deadline) {
    return absl::DeadlineExceededError(
        "the ImportKv deadline passed before the import started");
  }
  const std::string& id = request.sequence_id;
  const int32_t num_tokens = request.handle.num_tokens();
  // A cached block matches by hash of its token ids, salted with our
  // fingerprint: its K/V equal the source's only if the source runs the
  // same weights with the same layout. The caller checked the handle
  // (ValidateKvHandle) already; check again here so that no path reuses a
  // block before that check passed (and the source checks the pull too).
  absl::Status compatible = CheckCompatible(
      "the KV handle", request.handle.model_fingerprint(),
      FromProto(request.handle.layout()), fingerprint_, view_.layout);
  if (!compatible.ok()) return compatible;
  // The prompt's ids (all of them, or none: a handle that lacks them pulls
  // everything) let the reservation start from our cached prefix.
  absl::Span<const int32_t> token_ids;
  if (request.handle.prompt_token_ids_size() == num_tokens) {
    token_ids = absl::MakeConstSpan(request.handle.prompt_token_ids().data(),
                                    request.handle.prompt_token_ids_size());
  }

  // 1. Reserve, waiting for room; `cached` leading tokens need no pull.
  absl::StatusOr<KvReservation> reserved = Reserve(job, token_ids);
  if (!reserved.ok()) return reserved.status();
  SequenceKv kv = std::move(reserved->kv);
  const int32_t cached = reserved->cached_tokens;
  // AllocateDetached leaves the last token uncached; a violation would
  // make the pull empty (and the source refuse first_token).
  CHECK_LT(cached, num_tokens);

  // 2. Pull, on this thread.
  KvPullStats pull;
  KvTransport transport = KvTransport::kGrpc;
  absl::Status pulled = absl::OkStatus();
  absl::StatusOr<std::unique_ptr<Stream>> stream = device_.CreateStream();
  if (!stream.ok()) {
    pulled = stream.status();
  } else {
    KvPullParams params;
    params.handle = &request.handle;
    params.model_fingerprint = fingerprint_;
    params.view = &view_;
    params.destination = &kv;
    params.first_token = cached;
    params.token_ids = token_ids;
    params.stream = stream->get();
    if (options_.stream_chunk_layout == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN) {
      params.span_stagings = &span_stagings_;
    }
    params.call_deadline = request.deadline;
    params.pull_deadline =
        std::chrono::system_clock::now() + options_.pull_timeout;
    pulled = Pull(params, &transport, &pull);
  }

  // 3. Install (or give back the blocks and the seat), between steps.
  absl::Status installed = pulled;
  if (pulled.ok()) {
    installed = engine_.RunExclusive([&](ModelRunner& runner) {
      // With the ids, the pulled full blocks become cached too.
      return runner.Attach(id, kv, token_ids);
    });
  }
  if (!installed.ok()) {
    // Attach changes nothing when it fails: the blocks are still ours.
    engine_.GiveBackKvReservation(id, std::move(kv)).IgnoreError();
    LOG(WARNING) << "KV import of '" << id << "' from "
                 << request.handle.source_address() << " failed: " << installed;
    return installed;
  }
  KvImportResult result;
  result.num_tokens = num_tokens;
  result.transport = transport;
  result.transfer_bytes = pull.bytes;
  result.cached_tokens = cached;
  result.transfer_seconds = pull.seconds;
  result.import_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return result;
}

namespace {

bool Offers(const v1::KvHandle& handle, KvTransport transport) {
  const absl::string_view name = KvTransportName(transport);
  return std::find(handle.transports().begin(), handle.transports().end(),
                   name) != handle.transports().end();
}

}  // namespace

absl::Status KvImporter::Pull(const KvPullParams& params, KvTransport* used,
                              KvPullStats* stats) {
  auto record = [&](KvTransport transport, const absl::Status& status) {
    if (metrics_ == nullptr) return;
    metrics_->ObserveKvTransfer(transport, KvTransferDirection::kReceive,
                                status.ok() ? KvTransferOutcome::kOk
                                : stats->outcome == KvTransferOutcome::kOk
                                    ? KvTransferOutcome::kInternal
                                    : stats->outcome,
                                stats->bytes, stats->seconds);
  };
  const v1::KvHandle& handle = *params.handle;
  if (Offers(handle, KvTransport::kCudaIpc) &&
      device_.kind() == DeviceKind::kCuda && !host_id_.empty() &&
      handle.source_host_id() == host_id_) {
    *used = KvTransport::kCudaIpc;
    absl::Status status =
        PullKvOverCudaIpc(peers_, ipc_mappings_, params, stats);
    record(KvTransport::kCudaIpc, status);
    if (status.ok() || stats->outcome != KvTransferOutcome::kInternal) {
      return status;
    }
    LOG(WARNING) << "CUDA IPC pull from " << handle.source_address()
                 << " failed locally, falling back to the gRPC stream: "
                 << status;
    *stats = KvPullStats();
  } else if (Offers(handle, KvTransport::kNccl) && nccl_comms_ != nullptr) {
    *used = KvTransport::kNccl;
    absl::Status status = PullKvOverNccl(peers_, device_, *nccl_comms_,
                                         nccl_puller_id_, params, stats);
    record(KvTransport::kNccl, status);
    if (status.ok() || stats->outcome != KvTransferOutcome::kInternal) {
      return status;
    }
    LOG(WARNING) << "NCCL pull from " << handle.source_address()
                 << " not possible, falling back to the gRPC stream: "
                 << status;
    *stats = KvPullStats();
  }
  *used = KvTransport::kGrpc;
  absl::Status status = PullKvOverGrpc(peers_, params, stats);
  record(KvTransport::kGrpc, status);
  return status;
}

void KvImporter::RenewLeases() {
  const auto tick = std::min<std::chrono::milliseconds>(
      options_.renew_margin / 4, std::chrono::seconds(1));
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    renew_cv_.wait_for(lock, tick, [this] { return stopping_; });
    if (stopping_) return;
    // Copies: the calls run without the lock.
    std::vector<std::pair<std::string, RenewedLease>> due;
    const auto now = std::chrono::system_clock::now();
    for (const auto& [id, lease] : renewing_) {
      if (!lease.gone && lease.expiry - now < options_.renew_margin) {
        due.emplace_back(id, lease);
      }
    }
    if (due.empty()) continue;
    lock.unlock();
    // All at once (callback API): a source that does not answer must not
    // hold up the others' renewals. Each call is bounded by half the
    // margin, so a round ends well before any due lease expires.
    struct Call {
      grpc::ClientContext context;
      v1::RenewKvRequest request;
      v1::RenewKvResponse response;
      grpc::Status status;
    };
    std::vector<std::unique_ptr<Call>> calls;
    std::mutex done_mu;
    std::condition_variable done_cv;
    size_t done = 0;
    for (const auto& [id, lease] : due) {
      auto call = std::make_unique<Call>();
      call->context.set_deadline(
          std::chrono::system_clock::now() +
          std::min<std::chrono::milliseconds>(options_.renew_margin / 2,
                                              std::chrono::seconds(2)));
      call->request.set_lease_id(lease.lease_id);
      Call* c = call.get();
      v1::KvTransfer::NewStub(peers_.Get(lease.source_address))
          ->async()
          ->RenewKv(&c->context, &c->request, &c->response,
                    [c, &done_mu, &done_cv, &done](grpc::Status status) {
                      std::lock_guard<std::mutex> done_lock(done_mu);
                      c->status = std::move(status);
                      ++done;
                      done_cv.notify_one();
                    });
      calls.push_back(std::move(call));
    }
    {
      std::unique_lock<std::mutex> done_lock(done_mu);
      done_cv.wait(done_lock, [&] { return done == calls.size(); });
    }
    std::vector<std::pair<grpc::Status, int64_t>> answers;
    for (const auto& call : calls) {
      answers.emplace_back(call->status,
                           call->response.lease_expiry_unix_micros());
    }
    lock.lock();
    bool lost_any = false;
    for (size_t i = 0; i < due.size(); ++i) {
      auto it = renewing_.find(due[i].first);
      // Finished meanwhile, or queued again under the same id for another
      // lease.
      if (it == renewing_.end() ||
          it->second.lease_id != due[i].second.lease_id) {
        continue;
      }
      const grpc::Status& status = answers[i].first;
      if (status.ok()) {
        it->second.expiry = std::chrono::system_clock::time_point(
            std::chrono::microseconds(answers[i].second));
      } else if (status.error_code() == grpc::StatusCode::NOT_FOUND ||
                 status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                 status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
        // Expired, released, already pulled, or a source without RenewKv:
        // the pull will report what happened.
        it->second.gone = true;
        if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
          it->second.lost->store(true, std::memory_order_release);
          lost_any = true;
        }
        VLOG(1) << "RenewKv of lease " << due[i].second.lease_id << " on "
                << due[i].second.source_address
                << " stopped: " << status.error_message();
      }  // else: transient; the next tick tries again
    }
    // Imports waiting for room on a lost lease stop waiting now.
    if (lost_any) engine_.NotifyCancelled();
  }
}

void KvImporter::ReleaseLease(const v1::KvHandle& handle) {
  // A lost release only delays the source's free until the lease expires,
  // but on a busy source that is up to a TTL of blocks held for nothing:
  // retry once on a transport error (not on NOT_FOUND etc.: already gone).
  v1::KvTransfer::Stub stub(peers_.Get(handle.source_address()));
  v1::ReleaseKvRequest request;
  request.set_lease_id(handle.lease_id());
  grpc::Status status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    v1::ReleaseKvResponse response;
    status = stub.ReleaseKv(&context, request, &response);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      break;
    }
  }
  LOG_IF(WARNING, !status.ok())
      << "ReleaseKv of lease " << handle.lease_id() << " on "
      << handle.source_address()
      << " failed (the lease will expire): " << status.error_message();
}

}  // namespace pdworker
