// KvEventSink: one Publish reaches the ZMQ publisher and the gRPC stream as
// the same batch (sequence number, timestamp, events), read back from the
// replay socket (msgpack decoded here) and from SubscribeKvEvents.
#include "worker/server/kv_event_sink.h"

#include <chrono>
#include <cstring>
#include <iterator>
#include <msgpack.hpp>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "gtest/gtest.h"
#include "tests/kv_events/kv_event_test_util.h"
#include "tests/kv_events/kv_events_test_server.h"

namespace pdworker {
namespace {

namespace common = ::smg::grpc::common;
using kv_events_testing::Batch;
using kv_events_testing::KvEventsTestServer;
using kv_events_testing::RandomBatches;

uint64_t U64(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::POSITIVE_INTEGER);
  return o.via.u64;
}

std::string Field(const msgpack::object& map, const std::string& key,
                  msgpack::object* value) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    const msgpack::object& k = map.via.map.ptr[i].key;
    if (std::string(k.via.str.ptr, k.via.str.size) == key) {
      *value = map.via.map.ptr[i].val;
      return key;
    }
  }
  ADD_FAILURE() << "no key " << key;
  return "";
}

int64_t Bits(uint64_t v) {
  int64_t out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// The msgpack batch says what the proto batch says.
void ExpectSameBatch(const std::string& payload,
                     const common::KvEventBatch& proto) {
  msgpack::object_handle handle =
      msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.via.array.size, 3u);
  EXPECT_EQ(batch.via.array.ptr[0].via.f64, proto.timestamp());
  EXPECT_EQ(static_cast<int32_t>(U64(batch.via.array.ptr[2])), proto.dp_rank());
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, static_cast<uint32_t>(proto.events_size()));
  for (int i = 0; i < proto.events_size(); ++i) {
    const msgpack::object& e = events.via.array.ptr[i];
    const common::KvCacheEvent& p = proto.events(i);
    msgpack::object type, hashes, parent, tokens;
    Field(e, "type", &type);
    const std::string kind(type.via.str.ptr, type.via.str.size);
    if (kind == "BlockStored") {
      ASSERT_TRUE(p.has_stored());
      Field(e, "block_hashes", &hashes);
      Field(e, "parent_block_hash", &parent);
      Field(e, "token_ids", &tokens);
      ASSERT_EQ(hashes.via.array.size,
                static_cast<uint32_t>(p.stored().blocks_size()));
      uint32_t t = 0;
      for (int b = 0; b < p.stored().blocks_size(); ++b) {
        EXPECT_EQ(Bits(U64(hashes.via.array.ptr[b])),
                  p.stored().blocks(b).block_hash());
        for (const uint32_t token : p.stored().blocks(b).token_ids()) {
          EXPECT_EQ(U64(tokens.via.array.ptr[t++]), token);
        }
      }
      EXPECT_EQ(t, tokens.via.array.size);
      EXPECT_EQ(parent.type != msgpack::type::NIL,
                p.stored().has_parent_block_hash());
      if (parent.type != msgpack::type::NIL) {
        EXPECT_EQ(Bits(U64(parent)), p.stored().parent_block_hash());
      }
    } else if (kind == "BlockRemoved") {
      ASSERT_TRUE(p.has_removed());
      Field(e, "block_hashes", &hashes);
      ASSERT_EQ(hashes.via.array.size,
                static_cast<uint32_t>(p.removed().block_hashes_size()));
      for (uint32_t h = 0; h < hashes.via.array.size; ++h) {
        EXPECT_EQ(Bits(U64(hashes.via.array.ptr[h])),
                  p.removed().block_hashes(h));
      }
    } else {
      EXPECT_EQ(kind, "AllBlocksCleared");
      EXPECT_TRUE(p.has_cleared());
    }
  }
}

TEST(KvEventSinkTest, BothWiresCarryTheSameBatches) {
  KvEventPublisherOptions zmq_options;
  zmq_options.endpoint = "tcp://127.0.0.1:*";
  zmq_options.replay_endpoint = "tcp://127.0.0.1:*";
  zmq_options.topic = "kv@10.1.2.3@tiny-llama";
  auto publisher = KvEventPublisher::Create(zmq_options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  const std::string replay_endpoint = (*publisher)->replay_endpoint();
  KvEventSink sink(std::move(*publisher), std::make_unique<KvEventStream>());
  KvEventsTestServer server(sink.stream());

  grpc::ClientContext context;
  common::SubscribeKvEventsRequest request;
  auto reader = server.stub->SubscribeKvEvents(&context, request);
  reader->WaitForInitialMetadata();
  for (int i = 0; i < 1000 && sink.stream()->stats().subscribers == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  const std::vector<Batch> batches = RandomBatches(20, /*seed=*/31);
  size_t nonempty = 0;
  for (const Batch& batch : batches) {
    sink.Publish(batch);  // an empty one is not sent at all
    nonempty += batch.empty() ? 0 : 1;
  }
  ASSERT_LT(nonempty, batches.size()) << "the data should hold empty batches";
  EXPECT_EQ(sink.zmq()->stats().published, static_cast<int64_t>(nonempty));
  EXPECT_EQ(sink.stream()->stats().published, static_cast<int64_t>(nonempty));

  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect(replay_endpoint);
  std::vector<zmq::message_t> ask;
  ask.emplace_back();
  ask.emplace_back(std::string(8, '\0'));
  zmq::send_multipart(dealer, ask);

  for (size_t seq = 0; seq < nonempty; ++seq) {
    common::KvEventBatch proto;
    ASSERT_TRUE(reader->Read(&proto)) << "gRPC batch " << seq;
    EXPECT_EQ(proto.sequence_number(), seq);
    std::vector<zmq::message_t> frames;
    ASSERT_TRUE(zmq::recv_multipart(dealer, std::back_inserter(frames)))
        << "replayed batch " << seq;
    ASSERT_EQ(frames.size(), 4u);
    std::string seq_bytes = frames[2].to_string();
    uint64_t zmq_seq = 0;
    for (const unsigned char b : seq_bytes) zmq_seq = zmq_seq << 8 | b;
    EXPECT_EQ(zmq_seq, seq);
    ASSERT_NO_FATAL_FAILURE(ExpectSameBatch(frames[3].to_string(), proto));
  }
  context.TryCancel();
}

}  // namespace
}  // namespace pdworker
