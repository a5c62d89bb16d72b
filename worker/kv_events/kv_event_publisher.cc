#include "worker/kv_events/kv_event_publisher.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <iterator>
#include <utility>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

class KvEventPublisher::WakeFd {
 public:
  WakeFd() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~WakeFd() {
    if (fd_ >= 0) close(fd_);
  }
  WakeFd(const WakeFd&) = delete;
  WakeFd& operator=(const WakeFd&) = delete;

  int fd() const { return fd_; }
  // A full counter (2^64 - 2 signals unread) cannot happen; nothing to do
  // if the write fails anyway: the thread is already due to wake.
  void Signal() {
    const uint64_t one = 1;
    if (write(fd_, &one, sizeof one) < 0) return;
  }
  void Drain() {
    uint64_t count;
    if (read(fd_, &count, sizeof count) < 0) return;
  }

 private:
  const int fd_;
};

namespace {

// vLLM's END_SEQ: (-1).to_bytes(8, "big", signed=True).
constexpr char kEndSeq[8] = {'\xff', '\xff', '\xff', '\xff',
                             '\xff', '\xff', '\xff', '\xff'};

std::string BigEndian8(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
  return out;
}

// A message over `payload` without copying it: ZMQ's I/O thread drops the
// reference when the message is sent.
zmq::message_t SharedMessage(
    const std::shared_ptr<const std::string>& payload) {
  auto* ref = new std::shared_ptr<const std::string>(payload);
  return zmq::message_t(
      const_cast<char*>((*ref)->data()), (*ref)->size(),
      [](void* /*data*/, void* hint) {
        delete static_cast<std::shared_ptr<const std::string>*>(hint);
      },
      ref);
}

constexpr auto kMore = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
constexpr auto kLast = zmq::send_flags::dontwait;

}  // namespace

bool KvEventsEndpointBinds(absl::string_view endpoint) {
  return absl::StrContains(endpoint, "*") ||
         absl::StrContains(endpoint, "::") ||
         absl::StartsWith(endpoint, "ipc://") ||
         absl::StartsWith(endpoint, "inproc://");
}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Create(
    KvEventPublisherOptions options) {
  if (options.endpoint.empty()) {
    return absl::InvalidArgumentError(
        "--kv_events_endpoint is empty: give the ZMQ PUB address, e.g. "
        "tcp://*:5557 (bind) or tcp://indexer:5557 (connect)");
  }
  if (options.buffer_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_events_buffer_steps=", options.buffer_steps, " is negative"));
  }
  if (options.hwm < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_events_hwm=", options.hwm, " is negative (0 means no limit)"));
  }
  if (options.max_queue_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_events_max_queue_size=", options.max_queue_size,
                     " must be at least 1"));
  }
  std::unique_ptr<KvEventPublisher> publisher(
      new KvEventPublisher(std::move(options)));
  if (absl::Status opened = publisher->Open(); !opened.ok()) return opened;
  publisher->thread_ = std::thread([p = publisher.get()] { p->Run(); });
  return publisher;
}

KvEventPublisher::KvEventPublisher(KvEventPublisherOptions options)
    : options_(std::move(options)) {}

absl::Status KvEventPublisher::Open() {
  wake_ = std::make_unique<WakeFd>();
  if (wake_->fd() < 0) {
    return absl::InternalError("KV events: eventfd failed");
  }
  context_ = std::make_unique<zmq::context_t>(1);
  binds_ = KvEventsEndpointBinds(options_.endpoint);
  try {
    pub_ = std::make_unique<zmq::socket_t>(*context_, zmq::socket_type::pub);
    pub_->set(zmq::sockopt::sndhwm, options_.hwm);
    pub_->set(zmq::sockopt::xpub_nodrop, 1);
    pub_->set(zmq::sockopt::linger, 0);
    if (binds_) {
      pub_->bind(options_.endpoint);
    } else {
      pub_->connect(options_.endpoint);
    }
    endpoint_ = pub_->get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return absl::UnavailableError(absl::StrCat(
        "--kv_events_endpoint=", options_.endpoint, ": cannot ",
        binds_ ? "bind" : "connect", " the ZMQ PUB socket: ", e.what()));
  }
  if (!options_.replay_endpoint.empty()) {
    try {
      replay_ =
          std::make_unique<zmq::socket_t>(*context_, zmq::socket_type::router);
      // A reply queues every buffered batch it asks for and the end marker
      // at once, whole: no high-water mark (ZMQ's is approximate, and vLLM's
      // default 1000 silently cuts long replies). The queued batches share
      // the buffer's payloads and go with the peer if it disconnects.
      // ROUTER_MANDATORY makes a reply to a peer that is gone an error.
      replay_->set(zmq::sockopt::sndhwm, 0);
      replay_->set(zmq::sockopt::router_mandatory, 1);
      replay_->set(zmq::sockopt::linger, 0);
      replay_->bind(options_.replay_endpoint);
      replay_endpoint_ = replay_->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(
          absl::StrCat("--kv_events_replay_endpoint=", options_.replay_endpoint,
                       ": cannot bind the ZMQ ROUTER socket: ", e.what()));
    }
  }
  LOG(INFO) << "KV events: ZMQ PUB " << (binds_ ? "bound to " : "connected to ")
            << endpoint_ << ", topic '" << options_.topic << "', "
            << KvEventLayoutName(options_.format.layout) << " layout"
            << (replay_ ? absl::StrCat(", replay ROUTER on ", replay_endpoint_,
                                       " (", options_.buffer_steps, " batches)")
                        : std::string(", no replay socket"));
  return absl::OkStatus();
}

KvEventPublisher::~KvEventPublisher() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    Wake();
    thread_.join();
  }
}

uint64_t KvEventPublisher::Publish(absl::Span<const KvCacheEvent> events,
                                   double timestamp) {
  auto payload = std::make_shared<const std::string>(
      EncodeVllmEventBatch(events, timestamp, options_.format));
  uint64_t seq;
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_seq_++;
    if (options_.buffer_steps > 0) {
      buffer_.push_back({seq, payload});
      if (buffer_.size() > static_cast<size_t>(options_.buffer_steps)) {
        buffer_.pop_front();
      }
    }
    if (pending_.size() < static_cast<size_t>(options_.max_queue_size)) {
      pending_.push_back({seq, std::move(payload)});
      queued = true;
    }
  }
  if (queued) {
    Wake();
  } else {
    dropped_queue_.fetch_add(1, std::memory_order_relaxed);
  }
  return seq;
}

void KvEventPublisher::Wake() { wake_->Signal(); }

KvEventPublisher::Stats KvEventPublisher::stats() const {
  Stats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.published = static_cast<int64_t>(next_seq_);
  }
  s.sent = sent_.load(std::memory_order_relaxed);
  s.dropped_hwm = dropped_hwm_.load(std::memory_order_relaxed);
  s.dropped_queue = dropped_queue_.load(std::memory_order_relaxed);
  s.replay_requests = replay_requests_.load(std::memory_order_relaxed);
  s.replayed_batches = replayed_batches_.load(std::memory_order_relaxed);
  s.replays_cut = replays_cut_.load(std::memory_order_relaxed);
  return s;
}

void KvEventPublisher::Run() {
  zmq::pollitem_t items[2] = {
      {nullptr, wake_->fd(), ZMQ_POLLIN, 0},
      {replay_ ? replay_->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
  const size_t num_items = replay_ ? 2 : 1;
  while (true) {
    try {
      zmq::poll(items, num_items, std::chrono::milliseconds(-1));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      LOG(ERROR) << "KV events: poll failed, publisher stops: " << e.what();
      return;
    }
    if (items[0].revents & ZMQ_POLLIN) wake_->Drain();
    std::deque<Batch> batches;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      batches.swap(pending_);
    }
    for (const Batch& batch : batches) SendLive(batch);
    if (num_items == 2 && (items[1].revents & ZMQ_POLLIN)) ServeReplays();
  }
}

void KvEventPublisher::SendLive(const Batch& batch) {
  const std::string seq = BigEndian8(batch.seq);
  try {
    // XPUB_NODROP: EAGAIN (an empty result) here when a subscriber's pipe is
    // at its high-water mark; the frames after an accepted first one always
    // go (ZMQ delivers a multipart message whole or not at all).
    if (!pub_->send(zmq::buffer(options_.topic), kMore)) {
      dropped_hwm_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    pub_->send(zmq::buffer(seq), kMore);
    pub_->send(SharedMessage(batch.payload), kLast);
    sent_.fetch_add(1, std::memory_order_relaxed);
  } catch (const zmq::error_t& e) {
    dropped_hwm_.fetch_add(1, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 1000) << "KV events: PUB send failed: " << e.what();
  }
}

void KvEventPublisher::ServeReplays() {
  while (true) {
    std::vector<zmq::message_t> frames;
    try {
      if (!zmq::recv_multipart(*replay_, std::back_inserter(frames),
                               zmq::recv_flags::dontwait)) {
        return;
      }
    } catch (const zmq::error_t& e) {
      LOG(WARNING) << "KV events: replay receive failed: " << e.what();
      return;
    }
    // [identity, "", start]: what vLLM's ROUTER accepts (3 frames, the
    // start read as a big-endian integer).
    if (frames.size() != 3 || frames[2].empty() || frames[2].size() > 8) {
      LOG_EVERY_N(WARNING, 100) << "KV events: ignoring a replay request of "
                                << frames.size() << " frames";
      continue;
    }
    uint64_t start = 0;
    for (const unsigned char byte : frames[2].to_string_view()) {
      start = start << 8 | byte;
    }
    replay_requests_.fetch_add(1, std::memory_order_relaxed);
    std::vector<Batch> replies;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Batch& batch : buffer_) {
        if (batch.seq >= start) replies.push_back(batch);
      }
    }
    const zmq::message_t& identity = frames[0];
    auto send_reply = [&](absl::string_view topic, absl::string_view seq,
                          zmq::message_t payload) {
      try {
        if (!replay_->send(zmq::buffer(identity.data(), identity.size()),
                           kMore)) {
          return false;  // the requester's pipe is full
        }
        replay_->send(zmq::const_buffer(nullptr, 0), kMore);
        replay_->send(zmq::buffer(topic.data(), topic.size()), kMore);
        replay_->send(zmq::buffer(seq.data(), seq.size()), kMore);
        replay_->send(std::move(payload), kLast);
        return true;
      } catch (const zmq::error_t&) {
        return false;  // EHOSTUNREACH: the requester is gone
      }
    };
    bool whole = true;
    for (const Batch& batch : replies) {
      if (!send_reply(options_.topic, BigEndian8(batch.seq),
                      SharedMessage(batch.payload))) {
        whole = false;
        break;
      }
      replayed_batches_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!whole ||
        !send_reply("", absl::string_view(kEndSeq, 8), zmq::message_t())) {
      replays_cut_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

}  // namespace pdworker
