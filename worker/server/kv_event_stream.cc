#include "worker/server/kv_event_stream.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "worker/rpc/parsed_call.h"

namespace pdworker {
namespace {

namespace common = ::smg::grpc::common;

int64_t AsInt64(ExternalBlockHash hash) { return static_cast<int64_t>(hash); }

void FillStored(const BlockStoredEvent& e, common::KvBlocksStored* stored) {
  CHECK_GT(e.block_size, 0) << "BlockStored without a block size";
  CHECK_EQ(e.token_ids.size(), e.block_hashes.size() * e.block_size)
      << "BlockStored: " << e.block_hashes.size() << " blocks of "
      << e.block_size << " tokens carry " << e.token_ids.size() << " tokens";
  for (size_t i = 0; i < e.block_hashes.size(); ++i) {
    common::KvBlock* block = stored->add_blocks();
    block->set_block_hash(AsInt64(e.block_hashes[i]));
    const auto first = e.token_ids.begin() + i * e.block_size;
    for (auto t = first; t != first + e.block_size; ++t) {
      block->add_token_ids(static_cast<uint32_t>(*t));
    }
    block->set_block_size(e.block_size);
  }
  if (e.parent_block_hash.has_value()) {
    stored->set_parent_block_hash(AsInt64(*e.parent_block_hash));
  }
}

}  // namespace

common::KvEventBatch ToKvEventBatchProto(absl::Span<const KvCacheEvent> events,
                                         uint64_t sequence_number,
                                         double timestamp,
                                         std::optional<int32_t> dp_rank,
                                         uint64_t first_event_id) {
  common::KvEventBatch batch;
  batch.set_sequence_number(sequence_number);
  batch.set_timestamp(timestamp);
  if (dp_rank.has_value()) batch.set_dp_rank(*dp_rank);
  uint64_t event_id = first_event_id;
  for (const KvCacheEvent& event : events) {
    common::KvCacheEvent* out = batch.add_events();
    out->set_event_id(event_id++);
    std::visit(
        [&](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, BlockStoredEvent>) {
            FillStored(e, out->mutable_stored());
          } else if constexpr (std::is_same_v<T, BlockRemovedEvent>) {
            common::KvBlocksRemoved* removed = out->mutable_removed();
            for (const ExternalBlockHash h : e.block_hashes) {
              removed->add_block_hashes(AsInt64(h));
            }
          } else {
            out->mutable_cleared();
          }
        },
        event);
  }
  return batch;
}

// What the stream and its subscriptions share; a subscription holds it past
// the stream's end (gRPC deletes the reactor when the call is done).
struct KvEventStream::Hub {
  struct Entry {
    uint64_t seq = 0;
    grpc::ByteBuffer bytes;  // the serialized KvEventBatch
    size_t size = 0;
  };

  explicit Hub(const KvEventStreamOptions& o) : options(o) {
    options.history_batches = std::max<size_t>(options.history_batches, 1);
  }

  // The oldest sequence a subscriber can still be given.
  uint64_t OldestLocked() const {
    return history.empty() ? next_seq : history.front().seq;
  }

  KvEventStreamOptions options;
  std::mutex publish_mu;  // orders Publish calls; taken before mu

  std::mutex mu;
  std::deque<Entry> history;  // contiguous, ending at next_seq - 1
  size_t history_bytes = 0;
  uint64_t next_seq = 0;
  uint64_t next_event_id = 1;
  std::vector<Subscription*> subscriptions;
  bool closed = false;
  int64_t accepted = 0;
  int64_t refused = 0;
  int64_t dropped_slow = 0;
};

// One SubscribeKvEvents call: writes the history from its cursor on, one
// write at a time, and ends with the status it is given (once no write is
// in flight). Its state is guarded by the hub's mutex. gRPC never runs a
// reaction inline from a Start* call, so Start* and Finish are called with
// the mutex held.
class KvEventStream::Subscription final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  Subscription(std::shared_ptr<Hub> hub, uint64_t next)
      : hub_(std::move(hub)), next_(next) {}

  void StartLocked() {
    // A subscriber waiting for the first batch sees the call answered now.
    StartSendInitialMetadata();
    PumpLocked();
  }

  // Writes the next batch, or finishes, or waits.
  void PumpLocked() {
    if (writing_ || finished_) return;
    if (final_.has_value()) {
      finished_ = true;
      Finish(*final_);
      return;
    }
    const uint64_t oldest = hub_->OldestLocked();
    if (next_ < oldest) {
      ++hub_->dropped_slow;
      finished_ = true;
      Finish(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("SubscribeKvEvents: this subscriber fell behind the "
                       "batches pdworker keeps (it needs ",
                       next_, ", the oldest kept is ", oldest,
                       "); clear this worker's blocks and resubscribe with "
                       "start_sequence_number 0")));
      return;
    }
    if (next_ >= hub_->next_seq) return;  // up to date: wait for Publish
    write_buffer_ = hub_->history[next_ - oldest].bytes;  // shares the bytes
    ++next_;
    writing_ = true;
    StartWrite(&write_buffer_);
  }

  void EndLocked(const grpc::Status& status) {
    if (!final_.has_value()) final_ = status;
    PumpLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(hub_->mu);
    writing_ = false;
    if (!ok) {
      EndLocked(grpc::Status(grpc::StatusCode::CANCELLED,
                             "the subscriber went away"));
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(hub_->mu);
    EndLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      auto& subs = hub_->subscriptions;
      subs.erase(std::remove(subs.begin(), subs.end(), this), subs.end());
    }
    delete this;
  }

 private:
  const std::shared_ptr<Hub> hub_;
  uint64_t next_;  // the sequence to write next
  grpc::ByteBuffer write_buffer_;
  bool writing_ = false;
  bool finished_ = false;
  std::optional<grpc::Status> final_;
};

KvEventStream::KvEventStream(KvEventStreamOptions options)
    : hub_(std::make_shared<Hub>(options)) {}

KvEventStream::~KvEventStream() { Shutdown(); }

uint64_t KvEventStream::Publish(absl::Span<const KvCacheEvent> events,
                                double timestamp) {
  std::lock_guard<std::mutex> order(hub_->publish_mu);
  uint64_t seq;
  uint64_t first_event_id;
  {
    std::lock_guard<std::mutex> lock(hub_->mu);
    seq = hub_->next_seq;
    first_event_id = hub_->next_event_id;
  }
  // Built and serialized once, outside the lock subscribers take.
  Hub::Entry entry;
  entry.seq = seq;
  const common::KvEventBatch batch = ToKvEventBatchProto(
      events, seq, timestamp, hub_->options.dp_rank, first_event_id);
  entry.size = batch.ByteSizeLong();
  SerializeMessage(batch, &entry.bytes);

  std::lock_guard<std::mutex> lock(hub_->mu);
  hub_->history.push_back(std::move(entry));
  hub_->history_bytes += hub_->history.back().size;
  hub_->next_seq = seq + 1;
  hub_->next_event_id = first_event_id + events.size();
  while (hub_->history.size() > hub_->options.history_batches ||
         (hub_->history_bytes > hub_->options.history_bytes &&
          hub_->history.size() > 1)) {
    hub_->history_bytes -= hub_->history.front().size;
    hub_->history.pop_front();
  }
  for (Subscription* s : hub_->subscriptions) s->PumpLocked();
  return seq;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvEventStream::Subscribe(
    grpc::CallbackServerContext* /*context*/,
    const grpc::ByteBuffer* raw_request) {
  auto refuse = [this](grpc::Status status) {
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      ++hub_->refused;
    }
    return new ListWriter({}, std::move(status));
  };
  common::SubscribeKvEventsRequest request;
  if (grpc::Status parsed = ParseRequest(*raw_request, &request);
      !parsed.ok()) {
    return refuse(parsed);
  }
  const google::protobuf::UnknownFieldSet& unknown =
      request.GetReflection()->GetUnknownFields(request);
  if (unknown.field_count() > 0) {
    return refuse(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("SubscribeKvEventsRequest field ",
                     unknown.field(0).number(),
                     " is not supported: pdworker knows only "
                     "start_sequence_number (1), as smg-project/smg 14598503 "
                     "defines the message")));
  }
  const uint64_t cursor = request.start_sequence_number();

  std::lock_guard<std::mutex> lock(hub_->mu);
  auto refuse_locked = [this](grpc::StatusCode code,
                              const std::string& message) {
    ++hub_->refused;
    return new ListWriter({}, grpc::Status(code, message));
  };
  if (hub_->closed) {
    return refuse_locked(grpc::StatusCode::UNAVAILABLE,
                         "SubscribeKvEvents: the worker is shutting down");
  }
  const uint64_t oldest = hub_->OldestLocked();
  uint64_t next;
  if (cursor == 0) {
    // The whole history when it is the whole story, else what comes next.
    next = oldest == 0 ? 0 : hub_->next_seq;
  } else if (cursor >= hub_->next_seq) {
    return refuse_locked(
        grpc::StatusCode::OUT_OF_RANGE,
        absl::StrCat("start_sequence_number ", cursor,
                     " is past the newest KV event batch (",
                     hub_->next_seq == 0 ? std::string("none yet")
                                         : absl::StrCat(hub_->next_seq - 1),
                     "): it belongs to an earlier run of this worker; clear "
                     "its blocks and resubscribe with 0"));
  } else if (cursor + 1 < oldest) {
    return refuse_locked(
        grpc::StatusCode::OUT_OF_RANGE,
        absl::StrCat("start_sequence_number ", cursor, ": batch ", cursor + 1,
                     " is no longer kept (the oldest kept is ", oldest,
                     "); clear this worker's blocks and resubscribe with 0"));
  } else {
    next = cursor + 1;
  }
  auto* subscription = new Subscription(hub_, next);
  hub_->subscriptions.push_back(subscription);
  ++hub_->accepted;
  subscription->StartLocked();
  return subscription;
}

void KvEventStream::Shutdown() {
  std::lock_guard<std::mutex> lock(hub_->mu);
  hub_->closed = true;
  for (Subscription* s : hub_->subscriptions) {
    s->EndLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "SubscribeKvEvents: the worker is shutting "
                              "down"));
  }
}

KvEventStream::Stats KvEventStream::stats() const {
  std::lock_guard<std::mutex> lock(hub_->mu);
  Stats s;
  s.published = static_cast<int64_t>(hub_->next_seq);
  s.subscribers = static_cast<int64_t>(hub_->subscriptions.size());
  s.subscriptions = hub_->accepted;
  s.refused = hub_->refused;
  s.dropped_slow = hub_->dropped_slow;
  return s;
}

}  // namespace pdworker
