// KvEventPublisher: KV cache events on a ZMQ PUB socket, framed and encoded
// as vLLM's ZmqEventPublisher does, so llm-d's KV-cache indexer, Dynamo's KV
// router and SMG's relay read pdworker as they read vLLM, plus vLLM's replay
// ROUTER for subscribers that missed batches.
//
// Wire (vLLM, vllm/distributed/kv_events.py; see vllm_event_batch.h for the
// commits and the payload):
//   PUB message    [topic, seq as 8 bytes big-endian, msgpack KVEventBatch]
//                  one per Publish; seq counts from 0, +1 per batch.
//   replay ROUTER  request  [identity, "", start seq as 8 bytes big-endian]
//                  (what a DEALER sends as ["", start], or a REQ as [start])
//                  replies  [identity, "", topic, seq, payload] for every
//                  buffered batch with seq >= start, in order, then the end
//                  marker [identity, "", "", 8 x 0xff (-1 signed), ""].
//                  A request of any other shape is ignored.
//
// Bind or connect: exactly vLLM's rule: the PUB socket binds when the
// endpoint contains "*" or "::" or starts with ipc:// or inproc://
// ("tcp://*:5557"), and connects otherwise ("tcp://indexer:5557", to a SUB
// that binds, as llm-d's indexer does for pods it does not discover). The
// replay socket always binds.
//
// Never blocks the caller: Publish encodes the batch, numbers it, keeps it
// for replay and hands it to the publisher thread, which owns both sockets.
// The PUB socket sends with ZMQ_DONTWAIT and ZMQ_XPUB_NODROP, so a batch
// that would exceed a subscriber's high-water mark is not sent (to anyone)
// and is counted (dropped_hwm); it stays in the replay buffer, and the gap
// in the sequence numbers tells subscribers to replay it. A full hand-off
// queue (the thread stalled) drops and counts the same way (dropped_queue).
#ifndef PDWORKER_WORKER_KV_EVENTS_KV_EVENT_PUBLISHER_H_
#define PDWORKER_WORKER_KV_EVENTS_KV_EVENT_PUBLISHER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/kv_cache/kv_cache_events.h"
#include "worker/kv_events/vllm_event_batch.h"

namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq

namespace pdworker {

// vLLM's KVEventsConfig fields, with its defaults; the flag each comes from
// in parentheses (errors name it).
struct KvEventPublisherOptions {
  // PUB endpoint (--kv_events_endpoint), e.g. "tcp://*:5557" (bind) or
  // "tcp://10.0.0.7:5557" (connect). Required.
  std::string endpoint;
  // ROUTER endpoint for replays (--kv_events_replay_endpoint), e.g.
  // "tcp://*:5558"; empty: no replay socket.
  std::string replay_endpoint;
  // First frame of every message (--kv_events_topic); llm-d expects
  // "kv@<pod-ip>@<model>", subscribers filter on its prefix.
  std::string topic;
  // Batches kept for replay (--kv_events_buffer_steps).
  int buffer_steps = 10000;
  // PUB send high-water mark in messages per subscriber (--kv_events_hwm).
  int hwm = 100000;
  // Batches waiting for the publisher thread (--kv_events_max_queue_size).
  int max_queue_size = 100000;
  // The payload (--kv_events_layout, and what the batch says about us).
  VllmEventBatchFormat format;
};

// vLLM's rule: bind when `endpoint` names a wildcard ("*", "::") or a local
// transport (ipc://, inproc://), connect otherwise.
bool KvEventsEndpointBinds(absl::string_view endpoint);

class KvEventPublisher {
 public:
  struct Stats {
    int64_t published = 0;  // batches Publish numbered
    // Batches the PUB socket took: queued for every subscriber whose
    // subscription matches the topic (none when nobody subscribed yet).
    int64_t sent = 0;
    int64_t dropped_hwm = 0;    // not sent: a subscriber at its HWM
    int64_t dropped_queue = 0;  // not sent: the hand-off queue was full
    int64_t replay_requests = 0;
    int64_t replayed_batches = 0;
    int64_t replays_cut = 0;  // replies abandoned: requester gone or full
  };

  // Opens the sockets (binds or connects) and starts the publisher thread.
  // INVALID_ARGUMENT naming the flag for bad options, UNAVAILABLE when an
  // endpoint cannot be bound or connected.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Create(
      KvEventPublisherOptions options);

  // Stops the thread (batches still queued are dropped) and closes the
  // sockets without lingering.
  ~KvEventPublisher();

  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Any thread, never blocks on the network: one batch of `events` (which
  // may be empty) stamped `timestamp` (Unix seconds). Returns its sequence
  // number.
  uint64_t Publish(absl::Span<const KvCacheEvent> events, double timestamp);

  // The endpoints as bound or connected (a "*" port resolved), e.g. for
  // logs and for tests that bind port "*".
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }
  bool binds() const { return binds_; }

  Stats stats() const;

 private:
  struct Batch {
    uint64_t seq;
    std::shared_ptr<const std::string> payload;
  };
  class WakeFd;  // an eventfd the thread polls beside the replay socket

  explicit KvEventPublisher(KvEventPublisherOptions options);
  absl::Status Open();
  void Run();  // the publisher thread
  void SendLive(const Batch& batch);
  void ServeReplays();
  void Wake();

  const KvEventPublisherOptions options_;
  std::unique_ptr<zmq::context_t> context_;
  std::unique_ptr<zmq::socket_t> pub_;     // publisher thread only
  std::unique_ptr<zmq::socket_t> replay_;  // publisher thread only; or null
  std::string endpoint_;
  std::string replay_endpoint_;
  bool binds_ = false;
  std::unique_ptr<WakeFd> wake_;  // Publish and the destructor wake the thread

  mutable std::mutex mu_;
  uint64_t next_seq_ = 0;
  std::deque<Batch> buffer_;   // the last buffer_steps batches, for replay
  std::deque<Batch> pending_;  // numbered, not yet sent
  bool stopping_ = false;

  std::atomic<int64_t> sent_{0};
  std::atomic<int64_t> dropped_hwm_{0};
  std::atomic<int64_t> dropped_queue_{0};
  std::atomic<int64_t> replay_requests_{0};
  std::atomic<int64_t> replayed_batches_{0};
  std::atomic<int64_t> replays_cut_{0};

  std::thread thread_;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_EVENTS_KV_EVENT_PUBLISHER_H_
