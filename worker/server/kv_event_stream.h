// KvEventStream: KV cache events as SMG's `SubscribeKvEvents` gRPC stream
// (rpc SubscribeKvEvents(smg.grpc.common.SubscribeKvEventsRequest) returns
// (stream smg.grpc.common.KvEventBatch), on the vllm.grpc.engine.VllmEngine
// service: proto/vllm_engine.proto and proto/smg_common.proto, pinned to
// smg-project/smg 14598503246de9b562ab213c159a79250f55d6ed). Every live
// subscription gets every batch; the engine thread never waits for one.
//
// The stream numbers its batches from 0 (+1 per Publish) and keeps the last
// `history_batches` of them (within `history_bytes`), serialized once and
// shared by every subscriber. A subscriber's queue is the part of that
// history it has not written yet: one that falls behind the oldest batch
// kept ends with RESOURCE_EXHAUSTED, so a slow router costs memory bounded
// by the history and never blocks Publish.
//
// start_sequence_number, as SMG's own relay serves it (smg-project/smg
// crates/engine_servicer/src/kv_events.rs, 4e80904b): the last sequence the
// subscriber applied.
//   0      no cursor: the whole history when it still starts at batch 0 (the
//          subscriber then holds the worker's whole cache state), else live
//          batches only, from the next one.
//   N > 0  the batches after N that the history holds, then live ones;
//          OUT_OF_RANGE when N is newer than the newest batch (another
//          worker incarnation) or batch N+1 is no longer kept (the
//          subscriber must clear and resubscribe from 0).
// A request field this proto does not know (a newer SMG) is refused with
// INVALID_ARGUMENT naming its number.
//
// Each batch: sequence_number, timestamp (Unix seconds), dp_rank (set, as
// vLLM sets data_parallel_rank) and one KvCacheEvent per event, with an
// event_id counted from 1 over the stream's life. Stored blocks are split
// per block (token_ids, block_size); a hash travels as the int64 with the
// same 64 bits. cache_level and lora_id stay unset (the engine's own KV
// cache; no LoRA), group events are off.
#ifndef PDWORKER_WORKER_SERVER_KV_EVENT_STREAM_H_
#define PDWORKER_WORKER_SERVER_KV_EVENT_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/types/span.h"
#include "proto/smg_common.pb.h"
#include "worker/kv_cache/kv_cache_events.h"

namespace pdworker {

struct KvEventStreamOptions {
  // History kept for resuming and for lagging subscribers (SMG's relay and
  // vLLM's buffer_steps keep 10,000 batches).
  size_t history_batches = 10000;
  size_t history_bytes = size_t{64} << 20;
  // KvEventBatch.dp_rank; none leaves it unset.
  std::optional<int32_t> dp_rank = 0;
};

// One batch as SMG's proto, `first_event_id` for its first event. Every
// BlockStoredEvent must carry block_hashes.size() * block_size token ids
// (checked).
smg::grpc::common::KvEventBatch ToKvEventBatchProto(
    absl::Span<const KvCacheEvent> events, uint64_t sequence_number,
    double timestamp, std::optional<int32_t> dp_rank, uint64_t first_event_id);

class KvEventStream {
 public:
  struct Stats {
    int64_t published = 0;      // batches numbered
    int64_t subscribers = 0;    // live subscriptions now
    int64_t subscriptions = 0;  // accepted since the start
    int64_t refused = 0;        // calls refused (bad request, cursor, closed)
    int64_t dropped_slow = 0;   // ended RESOURCE_EXHAUSTED
  };

  explicit KvEventStream(KvEventStreamOptions options = {});
  // Ends every subscription (Shutdown) first.
  ~KvEventStream();

  KvEventStream(const KvEventStream&) = delete;
  KvEventStream& operator=(const KvEventStream&) = delete;

  // Any thread, never waits for a subscriber: one batch of `events` (which
  // may be empty) stamped `timestamp` (Unix seconds). Returns its sequence
  // number.
  uint64_t Publish(absl::Span<const KvCacheEvent> events, double timestamp);

  // The SubscribeKvEvents handler over a raw (grpc::ByteBuffer) method, as
  // VllmEngineService registers every method: parses the request (an
  // unparsable one is INVALID_ARGUMENT) and returns the call's reactor.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Subscribe(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* raw_request);

  // Ends every live subscription with UNAVAILABLE once its current write is
  // done and refuses later ones (drain). Publish keeps numbering.
  void Shutdown();

  Stats stats() const;

 private:
  struct Hub;
  class Subscription;
  const std::shared_ptr<Hub> hub_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_KV_EVENT_STREAM_H_
