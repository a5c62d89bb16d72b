// KvEventStream over real gRPC on 127.0.0.1: SMG's SubscribeKvEvents from a
// generated VllmEngine client. Every field of every batch, cursors inside
// and outside the history, requests it cannot honour, a slow subscriber
// dropped while a fast one gets everything, shutdown and cancellation.
#include "worker/server/kv_event_stream.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <variant>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kv_events/kv_event_test_util.h"
#include "tests/kv_events/kv_events_test_server.h"

namespace pdworker {
namespace {

namespace common = ::smg::grpc::common;
using kv_events_testing::Batch;
using kv_events_testing::KvEventsTestServer;
using kv_events_testing::RandomBatches;

double Ts(uint64_t i) { return 1767225600.0 + 0.5 * static_cast<double>(i); }

int64_t Bits(uint64_t hash) {
  int64_t v;
  std::memcpy(&v, &hash, sizeof v);
  return v;
}

// `got` is batch `seq` of `events`, stamped Ts(seq); event ids continue
// from *next_event_id.
void ExpectBatch(const common::KvEventBatch& got, uint64_t seq,
                 const Batch& events, uint64_t* next_event_id) {
  EXPECT_EQ(got.sequence_number(), seq);
  EXPECT_EQ(got.timestamp(), Ts(seq));
  EXPECT_TRUE(got.has_dp_rank());
  EXPECT_EQ(got.dp_rank(), 0);
  EXPECT_FALSE(got.group_events_enabled());
  EXPECT_EQ(got.group_events_size(), 0);
  ASSERT_EQ(got.events_size(), static_cast<int>(events.size()));
  for (size_t i = 0; i < events.size(); ++i) {
    const common::KvCacheEvent& e = got.events(static_cast<int>(i));
    EXPECT_EQ(e.event_id(), (*next_event_id)++);
    if (const auto* s = std::get_if<BlockStoredEvent>(&events[i])) {
      ASSERT_TRUE(e.has_stored()) << "batch " << seq << " event " << i;
      const common::KvBlocksStored& stored = e.stored();
      EXPECT_EQ(stored.has_parent_block_hash(),
                s->parent_block_hash.has_value());
      if (s->parent_block_hash.has_value()) {
        EXPECT_EQ(stored.parent_block_hash(), Bits(*s->parent_block_hash));
      }
      ASSERT_EQ(stored.blocks_size(), static_cast<int>(s->block_hashes.size()));
      for (int b = 0; b < stored.blocks_size(); ++b) {
        const common::KvBlock& block = stored.blocks(b);
        EXPECT_EQ(block.block_hash(), Bits(s->block_hashes[b]));
        EXPECT_EQ(block.block_size(), s->block_size);
        EXPECT_FALSE(block.has_lora_id());
        EXPECT_FALSE(block.has_cache_level());
        ASSERT_EQ(block.token_ids_size(), s->block_size);
        for (int t = 0; t < s->block_size; ++t) {
          EXPECT_EQ(block.token_ids(t),
                    static_cast<uint32_t>(s->token_ids[b * s->block_size + t]));
        }
      }
    } else if (const auto* r = std::get_if<BlockRemovedEvent>(&events[i])) {
      ASSERT_TRUE(e.has_removed());
      EXPECT_FALSE(e.removed().has_cache_level());
      ASSERT_EQ(e.removed().block_hashes_size(),
                static_cast<int>(r->block_hashes.size()));
      for (size_t h = 0; h < r->block_hashes.size(); ++h) {
        EXPECT_EQ(e.removed().block_hashes(static_cast<int>(h)),
                  Bits(r->block_hashes[h]));
      }
    } else {
      EXPECT_TRUE(e.has_cleared());
    }
  }
}

class KvEventStreamTest : public testing::Test {
 protected:
  void Start(KvEventStreamOptions options = {}) {
    stream_ = std::make_unique<KvEventStream>(options);
    server_ = std::make_unique<KvEventsTestServer>(stream_.get());
  }

  void TearDown() override {
    if (stream_ != nullptr) stream_->Shutdown();
    server_.reset();
  }

  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<common::KvEventBatch>> reader;
  };
  Call Subscribe(uint64_t start, bool unknown_field = false) {
    Call call;
    call.context = std::make_unique<grpc::ClientContext>();
    call.context->set_deadline(std::chrono::system_clock::now() +
                               std::chrono::seconds(60));
    common::SubscribeKvEventsRequest request;
    request.set_start_sequence_number(start);
    if (unknown_field) {
      request.GetReflection()->MutableUnknownFields(&request)->AddVarint(7, 1);
    }
    call.reader = server_->stub->SubscribeKvEvents(call.context.get(), request);
    return call;
  }

  // A refused call's status (it carries no batch).
  grpc::Status Refusal(uint64_t start, bool unknown_field = false) {
    Call call = Subscribe(start, unknown_field);
    common::KvEventBatch batch;
    EXPECT_FALSE(call.reader->Read(&batch));
    return call.reader->Finish();
  }

  void WaitForSubscribers(int64_t n) {
    for (int i = 0; i < 1000 && stream_->stats().subscribers != n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(stream_->stats().subscribers, n);
  }

  void Publish(const std::vector<Batch>& batches, size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
      EXPECT_EQ(stream_->Publish(batches[i], Ts(i)), i);
    }
  }

  // Reads batches first..last (inclusive) in order and checks them.
  void ReadAndCheck(Call& call, const std::vector<Batch>& batches,
                    uint64_t first, uint64_t last) {
    uint64_t event_id = 1;
    for (uint64_t i = 0; i < first; ++i) event_id += batches[i].size();
    for (uint64_t seq = first; seq <= last; ++seq) {
      common::KvEventBatch batch;
      ASSERT_TRUE(call.reader->Read(&batch))
          << "batch " << seq << ": " << call.reader->Finish().error_message();
      ASSERT_NO_FATAL_FAILURE(ExpectBatch(batch, seq, batches[seq], &event_id));
    }
  }

  std::unique_ptr<KvEventStream> stream_;
  std::unique_ptr<KvEventsTestServer> server_;
};

TEST_F(KvEventStreamTest, LiveSubscriberGetsEveryBatchWithEveryField) {
  Start();
  Call call = Subscribe(0);
  // Answered before any batch exists (a router awaits the call's headers).
  call.reader->WaitForInitialMetadata();
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(1));
  const std::vector<Batch> batches = RandomBatches(30, /*seed=*/99);
  Publish(batches, 0, batches.size());
  ReadAndCheck(call, batches, 0, batches.size() - 1);
  call.context->TryCancel();
}

TEST_F(KvEventStreamTest, HistoryFromZeroAndFromACursor) {
  Start();
  const std::vector<Batch> batches = RandomBatches(8, /*seed=*/4);
  Publish(batches, 0, 6);
  Call from_zero = Subscribe(0);    // the whole history: it starts at 0
  Call after_three = Subscribe(3);  // applied 0..3
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(2));
  Publish(batches, 6, 8);
  ReadAndCheck(from_zero, batches, 0, 7);
  ReadAndCheck(after_three, batches, 4, 7);
  from_zero.context->TryCancel();
  after_three.context->TryCancel();
}

TEST_F(KvEventStreamTest, CursorsOutsideTheHistoryAreOutOfRange) {
  KvEventStreamOptions options;
  options.history_batches = 3;
  Start(options);
  EXPECT_EQ(Refusal(1).error_code(), grpc::StatusCode::OUT_OF_RANGE)
      << "a cursor before any batch";
  const std::vector<Batch> batches = RandomBatches(8, /*seed=*/21);
  Publish(batches, 0, 6);  // keeps 3, 4, 5
  const grpc::Status ahead = Refusal(6);
  EXPECT_EQ(ahead.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(ahead.error_message(), testing::HasSubstr("newest"));
  const grpc::Status behind = Refusal(1);  // needs 2
  EXPECT_EQ(behind.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(behind.error_message(), testing::HasSubstr("oldest kept is 3"));

  Call after_two = Subscribe(2);  // needs 3: kept
  Call from_zero = Subscribe(0);  // history rolled: live from 6
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(2));
  // What is kept first: with 3 kept, publishing on before it is read would
  // (rightly) drop this subscriber.
  ReadAndCheck(after_two, batches, 3, 5);
  Publish(batches, 6, 8);
  ReadAndCheck(after_two, batches, 6, 7);
  ReadAndCheck(from_zero, batches, 6, 7);
  EXPECT_EQ(stream_->stats().refused, 3);
  after_two.context->TryCancel();
  from_zero.context->TryCancel();
}

TEST_F(KvEventStreamTest, AFieldItDoesNotKnowIsRefusedByNumber) {
  Start();
  const grpc::Status status = Refusal(0, /*unknown_field=*/true);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), testing::HasSubstr("field 7"));
  EXPECT_EQ(stream_->stats().subscriptions, 0);
}

TEST_F(KvEventStreamTest, ASlowSubscriberIsDroppedWithoutHoldingPublish) {
  KvEventStreamOptions options;
  options.history_batches = 4;
  Start(options);
  // ~200 KB batches: one fills the HTTP/2 window of a subscriber that
  // does not read.
  const std::vector<Batch> batches =
      RandomBatches(40, /*seed=*/8, /*block_size=*/16384);
  Call slow = Subscribe(0);
  Call fast = Subscribe(0);
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(2));
  // The fast subscriber takes each batch before the next one is published;
  // the slow one never reads until the end.
  std::atomic<uint64_t> fast_read{0};
  std::thread reader([&] {
    uint64_t event_id = 1;
    for (uint64_t seq = 0; seq < batches.size(); ++seq) {
      common::KvEventBatch batch;
      ASSERT_TRUE(fast.reader->Read(&batch)) << "fast subscriber at " << seq;
      ExpectBatch(batch, seq, batches[seq], &event_id);
      fast_read.store(seq + 1);
    }
  });
  for (size_t i = 0; i < batches.size(); ++i) {
    stream_->Publish(batches[i], Ts(i));
    for (int w = 0; w < 3000 && fast_read.load() <= i; ++w) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (fast_read.load() <= i) {
      ADD_FAILURE() << "the fast subscriber stalled at " << i;
      fast.context->TryCancel();
      break;
    }
  }
  reader.join();

  common::KvEventBatch batch;
  uint64_t received = 0;
  while (slow.reader->Read(&batch)) {
    EXPECT_EQ(batch.sequence_number(), received);
    ++received;
  }
  const grpc::Status status = slow.reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_THAT(status.error_message(), testing::HasSubstr("fell behind"));
  EXPECT_LT(received, batches.size());
  EXPECT_EQ(stream_->stats().dropped_slow, 1);
  fast.context->TryCancel();
}

TEST_F(KvEventStreamTest, ShutdownEndsSubscriptionsAndRefusesNewOnes) {
  Start();
  Call call = Subscribe(0);
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(1));
  stream_->Shutdown();
  common::KvEventBatch batch;
  EXPECT_FALSE(call.reader->Read(&batch));
  EXPECT_EQ(call.reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Refusal(0).error_code(), grpc::StatusCode::UNAVAILABLE);
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(0));
}

TEST_F(KvEventStreamTest, ACancelledSubscriberGoesAway) {
  Start();
  Call call = Subscribe(0);
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(1));
  call.context->TryCancel();
  ASSERT_NO_FATAL_FAILURE(WaitForSubscribers(0));
  const std::vector<Batch> batches = RandomBatches(3, /*seed=*/1);
  Publish(batches, 0, 3);
  EXPECT_EQ(stream_->stats().published, 3);
}

}  // namespace
}  // namespace pdworker
