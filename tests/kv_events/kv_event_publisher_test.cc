// KvEventPublisher over real ZMQ sockets on 127.0.0.1: vLLM's frames, the
// bind-or-connect rule, the replay ROUTER's protocol, and high-water-mark
// drops that are counted and recovered through the replay.
#include "worker/kv_events/kv_event_publisher.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kv_events/kv_event_test_util.h"

namespace pdworker {
namespace {

using kv_events_testing::Batch;
using kv_events_testing::RandomBatches;

constexpr char kTopic[] = "kv@10.1.2.3@tiny-llama";

std::string BigEndian(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
  return out;
}

uint64_t FromBigEndian(const zmq::message_t& m) {
  EXPECT_EQ(m.size(), 8u);
  uint64_t v = 0;
  for (const unsigned char b : m.to_string_view()) v = v << 8 | b;
  return v;
}

double Ts(uint64_t i) { return 1767225600.0 + 0.25 * static_cast<double>(i); }

// Receives one multipart message within `timeout`, or none.
std::optional<std::vector<zmq::message_t>> Receive(
    zmq::socket_t& socket, std::chrono::milliseconds timeout) {
  socket.set(zmq::sockopt::rcvtimeo, static_cast<int>(timeout.count()));
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(socket, std::back_inserter(frames))) {
    return std::nullopt;
  }
  return frames;
}

// Publishes empty batches until `sub` receives one (its subscription has
// reached the publisher); returns that batch's sequence number and drains
// the rest.
uint64_t PublishUntilSubscribed(KvEventPublisher& publisher,
                                zmq::socket_t& sub) {
  for (int i = 0; i < 500; ++i) {
    publisher.Publish({}, 0.0);
    if (auto frames = Receive(sub, std::chrono::milliseconds(20))) {
      uint64_t seq = FromBigEndian((*frames)[1]);
      while (auto more = Receive(sub, std::chrono::milliseconds(100))) {
        seq = FromBigEndian((*more)[1]);
      }
      return seq;
    }
  }
  ADD_FAILURE() << "the subscription never reached the publisher";
  return 0;
}

KvEventPublisherOptions BoundOptions() {
  KvEventPublisherOptions options;
  options.endpoint = "tcp://127.0.0.1:*";
  options.replay_endpoint = "tcp://127.0.0.1:*";
  options.topic = kTopic;
  return options;
}

// The replies to one replay request from a DEALER: (seq, topic, payload)
// until the end marker, whose frames are checked too.
struct Replayed {
  uint64_t seq;
  std::string topic;
  std::string payload;
};
std::vector<Replayed> Replay(zmq::socket_t& dealer, uint64_t start) {
  std::vector<zmq::message_t> request;
  request.emplace_back();
  request.emplace_back(BigEndian(start));
  zmq::send_multipart(dealer, request);
  std::vector<Replayed> out;
  while (true) {
    auto frames = Receive(dealer, std::chrono::milliseconds(5000));
    if (!frames) {
      ADD_FAILURE() << "no end marker after " << out.size() << " replies";
      return out;
    }
    if (frames->size() != 4 || !(*frames)[0].empty()) {
      ADD_FAILURE() << "a replay reply of " << frames->size() << " frames";
      return out;
    }
    if ((*frames)[2].to_string() == std::string(8, '\xff')) {
      EXPECT_TRUE((*frames)[1].empty()) << "end marker with a topic";
      EXPECT_TRUE((*frames)[3].empty()) << "end marker with a payload";
      return out;
    }
    out.push_back({FromBigEndian((*frames)[2]), (*frames)[1].to_string(),
                   (*frames)[3].to_string()});
  }
}

TEST(KvEventsEndpointTest, BindsOrConnectsAsVllmDecides) {
  EXPECT_TRUE(KvEventsEndpointBinds("tcp://*:5557"));
  EXPECT_TRUE(KvEventsEndpointBinds("tcp://127.0.0.1:*"));
  EXPECT_TRUE(KvEventsEndpointBinds("tcp://[::]:5557"));
  EXPECT_TRUE(KvEventsEndpointBinds("ipc:///tmp/kv-events"));
  EXPECT_TRUE(KvEventsEndpointBinds("inproc://kv-events"));
  EXPECT_FALSE(KvEventsEndpointBinds("tcp://localhost:5557"));
  EXPECT_FALSE(KvEventsEndpointBinds("tcp://10.0.0.7:5557"));
  EXPECT_FALSE(KvEventsEndpointBinds("tcp://indexer.llm-d.svc:5557"));
}

TEST(KvEventPublisherTest, BadOptionsNameTheFlag) {
  KvEventPublisherOptions options;
  auto empty = KvEventPublisher::Create(options);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(),
              testing::HasSubstr("--kv_events_endpoint"));

  options.endpoint = "tcp://127.0.0.1:*";
  options.max_queue_size = 0;
  EXPECT_THAT(KvEventPublisher::Create(options).status().message(),
              testing::HasSubstr("--kv_events_max_queue_size"));

  options.max_queue_size = 8;
  options.endpoint = "bogus://nowhere";
  auto bad = KvEventPublisher::Create(options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(bad.status().message(),
              testing::HasSubstr("--kv_events_endpoint=bogus://nowhere"));

  // The replay port taken by another publisher.
  auto first = KvEventPublisher::Create(BoundOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  options = BoundOptions();
  options.replay_endpoint = (*first)->replay_endpoint();
  auto taken = KvEventPublisher::Create(options);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(taken.status().message(),
              testing::HasSubstr("--kv_events_replay_endpoint"));
}

TEST(KvEventPublisherTest, BoundPublisherSendsVllmFramesAndReplays) {
  KvEventPublisherOptions options = BoundOptions();
  options.buffer_steps = 8;
  auto publisher = KvEventPublisher::Create(options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  ASSERT_TRUE((*publisher)->binds());

  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::subscribe, "kv@");
  sub.connect((*publisher)->endpoint());
  // A subscriber to another topic sees nothing.
  zmq::socket_t other(ctx, zmq::socket_type::sub);
  other.set(zmq::sockopt::linger, 0);
  other.set(zmq::sockopt::subscribe, "kv@10.9.9.9");
  other.connect((*publisher)->endpoint());
  const uint64_t probe = PublishUntilSubscribed(**publisher, sub);

  const std::vector<Batch> batches = RandomBatches(12, /*seed=*/7);
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_EQ((*publisher)->Publish(batches[i], Ts(i)), probe + 1 + i);
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    auto frames = Receive(sub, std::chrono::milliseconds(5000));
    ASSERT_TRUE(frames.has_value()) << "batch " << i << " never arrived";
    ASSERT_EQ(frames->size(), 3u);
    EXPECT_EQ((*frames)[0].to_string(), kTopic);
    EXPECT_EQ((*frames)[1].to_string(), BigEndian(probe + 1 + i));
    EXPECT_EQ((*frames)[2].to_string(),
              EncodeVllmEventBatch(batches[i], Ts(i), options.format));
  }
  EXPECT_FALSE(Receive(other, std::chrono::milliseconds(50)).has_value());

  // Replay from a sequence inside the buffer: everything from it, with the
  // topic, then the end marker.
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect((*publisher)->replay_endpoint());
  const uint64_t newest = probe + batches.size();
  std::vector<Replayed> replayed = Replay(dealer, newest - 2);
  ASSERT_EQ(replayed.size(), 3u);
  for (size_t k = 0; k < replayed.size(); ++k) {
    const uint64_t seq = newest - 2 + k;
    EXPECT_EQ(replayed[k].seq, seq);
    EXPECT_EQ(replayed[k].topic, kTopic);
    const size_t i = seq - probe - 1;
    EXPECT_EQ(replayed[k].payload,
              EncodeVllmEventBatch(batches[i], Ts(i), options.format));
  }
  // From 0: only the 8 batches the buffer keeps.
  replayed = Replay(dealer, 0);
  ASSERT_EQ(replayed.size(), 8u);
  EXPECT_EQ(replayed.front().seq, newest - 7);
  EXPECT_EQ(replayed.back().seq, newest);
  // Past the newest: the end marker alone.
  EXPECT_TRUE(Replay(dealer, newest + 1).empty());

  // A request of another shape is ignored; the next good one is served.
  std::vector<zmq::message_t> bad;
  bad.emplace_back(std::string("x"));
  zmq::send_multipart(dealer, bad);
  EXPECT_EQ(Replay(dealer, newest).size(), 1u);

  const KvEventPublisher::Stats stats = (*publisher)->stats();
  EXPECT_EQ(stats.published, static_cast<int64_t>(newest + 1));
  EXPECT_EQ(stats.dropped_hwm, 0);
  EXPECT_EQ(stats.replay_requests, 4);
  EXPECT_EQ(stats.replayed_batches, 3 + 8 + 0 + 1);
}

TEST(KvEventPublisherTest, ConnectsToABoundSubscriber) {
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::subscribe, kTopic);
  sub.bind("tcp://127.0.0.1:*");
  const std::string endpoint = sub.get(zmq::sockopt::last_endpoint);

  KvEventPublisherOptions options;
  options.endpoint = endpoint;  // no wildcard: connect
  options.topic = kTopic;
  options.format.layout = KvEventLayout::kPositional;
  auto publisher = KvEventPublisher::Create(options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  EXPECT_FALSE((*publisher)->binds());
  EXPECT_EQ((*publisher)->endpoint(), endpoint);
  EXPECT_TRUE((*publisher)->replay_endpoint().empty());

  const uint64_t probe = PublishUntilSubscribed(**publisher, sub);
  const std::vector<Batch> batches = RandomBatches(5, /*seed=*/11);
  for (size_t i = 0; i < batches.size(); ++i) {
    (*publisher)->Publish(batches[i], Ts(i));
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    auto frames = Receive(sub, std::chrono::milliseconds(5000));
    ASSERT_TRUE(frames.has_value());
    ASSERT_EQ(frames->size(), 3u);
    EXPECT_EQ(FromBigEndian((*frames)[1]), probe + 1 + i);
    EXPECT_EQ((*frames)[2].to_string(),
              EncodeVllmEventBatch(batches[i], Ts(i), options.format));
  }
}

TEST(KvEventPublisherTest, PublishNeverWaitsForAnUnreachableSubscriber) {
  KvEventPublisherOptions options;
  options.endpoint = "tcp://127.0.0.1:1";  // connect; nobody listens
  options.hwm = 4;
  auto publisher = KvEventPublisher::Create(options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  const std::vector<Batch> batches = RandomBatches(50, /*seed=*/3);
  for (size_t i = 0; i < 2000; ++i) {
    (*publisher)->Publish(batches[i % batches.size()], Ts(i));
  }
  // All handled (a peer that never subscribed matches no message, so ZMQ
  // takes them and delivers them to nobody), none waited for.
  for (int i = 0; i < 500; ++i) {
    const KvEventPublisher::Stats s = (*publisher)->stats();
    if (s.sent + s.dropped_hwm + s.dropped_queue == 2000) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const KvEventPublisher::Stats s = (*publisher)->stats();
  EXPECT_EQ(s.published, 2000);
  EXPECT_EQ(s.sent + s.dropped_hwm + s.dropped_queue, 2000);
}

TEST(KvEventPublisherTest, HwmDropsAreCountedAndReplayed) {
  // Unix sockets (ipc://, which binds by vLLM's rule): their ~200 KB of
  // kernel buffer fill with a few MB, where loopback TCP takes tens.
  const std::string base =
      absl::StrCat("ipc:///tmp/pdworker-kv-events-test-", getpid());
  KvEventPublisherOptions options;
  options.endpoint = base + "-pub";
  options.replay_endpoint = base + "-replay";
  options.topic = kTopic;
  options.hwm = 1;
  options.buffer_steps = 1000;
  auto publisher = KvEventPublisher::Create(options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  EXPECT_TRUE((*publisher)->binds());

  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::rcvhwm, 1);
  sub.set(zmq::sockopt::rcvbuf, 16384);
  sub.set(zmq::sockopt::subscribe, "");
  sub.connect((*publisher)->endpoint());
  const uint64_t probe = PublishUntilSubscribed(**publisher, sub);

  // 40 batches of ~60 KB while the subscriber reads nothing: far more than
  // its pipes and socket buffers hold.
  const std::vector<Batch> batches =
      RandomBatches(40, /*seed=*/5, /*block_size=*/4096);
  for (size_t i = 0; i < batches.size(); ++i) {
    (*publisher)->Publish(batches[i], Ts(i));
  }
  const int64_t total = static_cast<int64_t>(probe + 1 + batches.size());
  for (int i = 0; i < 2000; ++i) {
    const KvEventPublisher::Stats s = (*publisher)->stats();
    if (s.sent + s.dropped_hwm + s.dropped_queue == total) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const KvEventPublisher::Stats stats = (*publisher)->stats();
  EXPECT_EQ(stats.published, total);
  EXPECT_EQ(stats.sent + stats.dropped_hwm + stats.dropped_queue, total);
  EXPECT_GT(stats.dropped_hwm, 0);
  EXPECT_EQ(stats.dropped_queue, 0);

  // What arrived live is in order with gaps; the replay fills them.
  std::vector<uint64_t> live;
  while (auto frames = Receive(sub, std::chrono::milliseconds(500))) {
    live.push_back(FromBigEndian((*frames)[1]));
  }
  ASSERT_FALSE(live.empty());
  EXPECT_TRUE(std::is_sorted(live.begin(), live.end()));
  EXPECT_LT(live.size(), batches.size());

  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect((*publisher)->replay_endpoint());
  const std::vector<Replayed> replayed = Replay(dealer, probe + 1);
  ASSERT_EQ(replayed.size(), batches.size());
  for (size_t i = 0; i < replayed.size(); ++i) {
    ASSERT_EQ(replayed[i].seq, probe + 1 + i);
    EXPECT_EQ(replayed[i].payload,
              EncodeVllmEventBatch(batches[i], Ts(i), options.format));
  }
}

}  // namespace
}  // namespace pdworker
