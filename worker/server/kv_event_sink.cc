#include "worker/server/kv_event_sink.h"

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdworker {

KvEventSink::KvEventSink(std::unique_ptr<KvEventPublisher> zmq,
                         std::unique_ptr<KvEventStream> stream)
    : zmq_(std::move(zmq)), stream_(std::move(stream)) {}

void KvEventSink::Publish(absl::Span<const KvCacheEvent> events) {
  if (events.empty()) return;
  const double timestamp = absl::ToUnixMicros(absl::Now()) * 1e-6;
  if (zmq_ != nullptr) zmq_->Publish(events, timestamp);
  if (stream_ != nullptr) stream_->Publish(events, timestamp);
}

}  // namespace pdworker
