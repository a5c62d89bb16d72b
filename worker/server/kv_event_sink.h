// KvEventSink: where the engine thread hands the prefix cache's events. One
// Publish is one batch, stamped once, sent to the ZMQ publisher (vLLM's
// wire, for llm-d and Dynamo) and to the gRPC stream (SMG's
// SubscribeKvEvents); either may be absent. Neither ever blocks the caller.
#ifndef PDWORKER_WORKER_SERVER_KV_EVENT_SINK_H_
#define PDWORKER_WORKER_SERVER_KV_EVENT_SINK_H_

#include <memory>

#include "absl/types/span.h"
#include "worker/kv_cache/kv_cache_events.h"
#include "worker/kv_events/kv_event_publisher.h"
#include "worker/server/kv_event_stream.h"

namespace pdworker {

class KvEventSink final : public KvEventListener {
 public:
  // Either (or both) may be null.
  KvEventSink(std::unique_ptr<KvEventPublisher> zmq,
              std::unique_ptr<KvEventStream> stream);

  // The events of one engine step, in order; nothing is sent for none (as
  // vLLM publishes a batch only for a step that has events).
  void Publish(absl::Span<const KvCacheEvent> events) override;

  KvEventPublisher* zmq() const { return zmq_.get(); }
  // What VllmEngineService::SubscribeKvEvents hands its calls to.
  KvEventStream* stream() const { return stream_.get(); }

 private:
  const std::unique_ptr<KvEventPublisher> zmq_;
  const std::unique_ptr<KvEventStream> stream_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_SERVER_KV_EVENT_SINK_H_
