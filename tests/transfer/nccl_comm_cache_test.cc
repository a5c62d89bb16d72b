// NcclCommCache's bookkeeping on the CPU, with a fake communicator factory:
// one communicator per peer, made once and reused; transfers over a pair
// serialized; a failed one dropped and remade; dropped when the peer goes
// away or restarts and at shutdown; an abort (a deadline, a drop, the
// shutdown) unblocking the holder and whoever waits for the pair. Last, the
// NCCL transport's pack / send / receive / unpack path (NcclSendKv,
// NcclRecvKv) between two caches over the fake, twice over one pair.
//
// Nothing here asserts a duration: waits are bounded by far deadlines, and
// a test that finishes shows the abort unblocked them.
#include "worker/transfer/nccl_comm_cache.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/nccl_transfer.h"

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point Far() { return Clock::now() + std::chrono::hours(1); }

// A fake NCCL in this process. The two ranks of a unique id share a wire:
// Send queues the bytes (after the stream's queued work, as ncclSend runs
// after it), Recv takes the oldest or waits for one until its deadline or
// an abort — a silent peer is one that never sends.
class FakeNccl final : public NcclCommFactory {
 public:
  struct Wire {
    std::mutex mu;
    std::deque<std::string> messages;
  };

  absl::StatusOr<std::string> NewUniqueId() override {
    std::lock_guard<std::mutex> lock(mu_);
    return absl::StrCat("id-", ++ids_);
  }

  absl::StatusOr<std::unique_ptr<NcclComm>> Join(
      const std::string& unique_id, NcclRank /*rank*/,
      const NcclWait& /*wait*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_joins_) return absl::UnavailableError("the peer never joined");
    ++joins_;
    std::shared_ptr<Wire>& wire = wires_[unique_id];
    if (wire == nullptr) wire = std::make_shared<Wire>();
    return std::unique_ptr<NcclComm>(new Comm(this, wire));
  }

  void set_fail_joins(bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_joins_ = fail;
  }
  void set_fail_transfers(bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_transfers_ = fail;
  }
  int joins() const {
    std::lock_guard<std::mutex> lock(mu_);
    return joins_;
  }
  int destroyed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return destroyed_;
  }
  // Recv calls waiting for bytes now.
  int receiving() const { return receiving_.load(); }

 private:
  class Comm final : public NcclComm {
   public:
    Comm(FakeNccl* nccl, std::shared_ptr<Wire> wire)
        : nccl_(nccl), wire_(std::move(wire)) {}
    ~Comm() override {
      std::lock_guard<std::mutex> lock(nccl_->mu_);
      ++nccl_->destroyed_;
    }

    absl::Status Send(const void* data, size_t bytes, Stream& stream,
                      const NcclWait& /*wait*/) override {
      if (nccl_->failing()) return absl::UnavailableError("the peer died");
      if (absl::Status s = stream.Synchronize(); !s.ok()) return s;
      std::lock_guard<std::mutex> lock(wire_->mu);
      wire_->messages.emplace_back(static_cast<const char*>(data), bytes);
      return absl::OkStatus();
    }

    absl::Status Recv(void* data, size_t bytes, Stream& stream,
                      const NcclWait& wait) override {
      if (nccl_->failing()) return absl::UnavailableError("the peer died");
      if (absl::Status s = stream.Synchronize(); !s.ok()) return s;
      ++nccl_->receiving_;
      absl::Status status = Take(data, bytes, wait);
      --nccl_->receiving_;
      return status;
    }

   private:
    absl::Status Take(void* data, size_t bytes, const NcclWait& wait) {
      for (;;) {
        {
          std::lock_guard<std::mutex> lock(wire_->mu);
          if (!wire_->messages.empty()) {
            const std::string message = std::move(wire_->messages.front());
            wire_->messages.pop_front();
            if (message.size() != bytes) {
              return absl::InternalError(absl::StrCat(
                  "sent ", message.size(), " bytes, expected ", bytes));
            }
            std::memcpy(data, message.data(), bytes);
            return absl::OkStatus();
          }
        }
        if (wait.aborted()) return absl::UnavailableError("aborted");
        if (Clock::now() >= wait.deadline) {
          return absl::UnavailableError("the peer did not finish in time");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // poll
      }
    }

    FakeNccl* const nccl_;
    const std::shared_ptr<Wire> wire_;
  };

  bool failing() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fail_transfers_;
  }

  mutable std::mutex mu_;
  int ids_ = 0;
  int joins_ = 0;
  int destroyed_ = 0;
  bool fail_joins_ = false;
  bool fail_transfers_ = false;
  std::map<std::string, std::shared_ptr<Wire>> wires_;
  std::atomic<int> receiving_{0};
};

// Yields until `done` (a state another thread reaches without waiting on
// this one); never a timing assertion.
template <typename Predicate>
void AwaitState(Predicate done) {
  while (!done()) std::this_thread::yield();
}

class NcclCommCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { stream_ = *device_.CreateStream(); }

  // A transfer through `lease` (joined as the puller first): a byte sent
  // and taken back (both ends of the fake's wire are reachable from one).
  absl::Status Use(NcclCommCache::Lease& lease) {
    if (absl::Status s = lease.Join(NcclRank::kPuller, Far()); !s.ok()) {
      return s;
    }
    char byte = 7;
    if (absl::Status s = lease.Send(&byte, 1, *stream_, Far()); !s.ok()) {
      return s;
    }
    return lease.Recv(&byte, 1, *stream_, Far());
  }

  CpuDevice device_;
  std::unique_ptr<Stream> stream_;
  FakeNccl nccl_;
};

TEST_F(NcclCommCacheTest, KeepsOneCommunicatorPerPeerAndReusesIt) {
  NcclCommCache cache(nccl_, 4);
  int64_t generation = 0;
  {
    absl::StatusOr<NcclCommCache::Lease> first =
        cache.Acquire("prefill-0:50051", "epoch-a", Far());
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_FALSE(first->joined());
    EXPECT_EQ(first->unique_id(), "id-1");
    generation = first->generation();
    ASSERT_TRUE(Use(*first).ok());
  }
  EXPECT_EQ(cache.size(), 1);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<NcclCommCache::Lease> again =
        cache.Acquire("prefill-0:50051", "epoch-a", Far());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->joined());
    EXPECT_EQ(again->generation(), generation);
    ASSERT_TRUE(Use(*again).ok());
  }
  EXPECT_EQ(nccl_.joins(), 1);
  EXPECT_EQ(nccl_.destroyed(), 0);

  absl::StatusOr<NcclCommCache::Lease> other =
      cache.Acquire("prefill-1:50051", "epoch-b", Far());
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->joined());
  EXPECT_NE(other->generation(), generation);
  EXPECT_EQ(other->unique_id(), "id-2");
  ASSERT_TRUE(Use(*other).ok());
  EXPECT_EQ(cache.size(), 2);
}

TEST_F(NcclCommCacheTest, SerializesTransfersOverOnePair) {
  NcclCommCache cache(nccl_, 4);
  std::optional<NcclCommCache::Lease> holder;
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(Use(*lease).ok());
    holder.emplace(*std::move(lease));
  }
  auto waiter = std::async(std::launch::async,
                           [&] { return cache.Acquire("p", "e", Far()); });
  AwaitState([&] { return cache.waiting() == 1; });
  EXPECT_EQ(waiter.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout);
  const int64_t generation = holder->generation();
  holder.reset();  // the first transfer ends
  absl::StatusOr<NcclCommCache::Lease> next = waiter.get();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->joined());
  EXPECT_EQ(next->generation(), generation);
  EXPECT_EQ(cache.waiting(), 0);
}

TEST_F(NcclCommCacheTest, WaiterGivesUpAtItsDeadline) {
  NcclCommCache cache(nccl_, 4);
  absl::StatusOr<NcclCommCache::Lease> held = cache.Acquire("p", "e", Far());
  ASSERT_TRUE(held.ok());
  absl::StatusOr<NcclCommCache::Lease> late =
      cache.Acquire("p", "e", Clock::now() + std::chrono::milliseconds(5));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded)
      << late.status();
  EXPECT_EQ(cache.waiting(), 0);
}

// A failed transfer aborts the communicator before returning (a kernel
// still waiting stops before the caller frees its buffer), and the pair's
// next transfer makes a new one.
TEST_F(NcclCommCacheTest, FailedTransferDropsAndRemakes) {
  NcclCommCache cache(nccl_, 4);
  int64_t generation = 0;
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
    generation = lease->generation();
    ASSERT_TRUE(lease->Join(NcclRank::kPuller, Far()).ok());
    nccl_.set_fail_transfers(true);
    char byte = 0;
    EXPECT_EQ(lease->Recv(&byte, 1, *stream_, Far()).code(),
              absl::StatusCode::kUnavailable);
    EXPECT_EQ(nccl_.destroyed(), 1);
    EXPECT_FALSE(lease->joined());
  }
  EXPECT_EQ(cache.size(), 0);
  nccl_.set_fail_transfers(false);
  absl::StatusOr<NcclCommCache::Lease> again = cache.Acquire("p", "e", Far());
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->joined());
  EXPECT_NE(again->generation(), generation);
  EXPECT_EQ(again->unique_id(), "id-2");
  ASSERT_TRUE(Use(*again).ok());
  EXPECT_EQ(nccl_.joins(), 2);
}

TEST_F(NcclCommCacheTest, FailedJoinIsNotKept) {
  NcclCommCache cache(nccl_, 4);
  nccl_.set_fail_joins(true);
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(lease->Join(NcclRank::kPuller, Far()).code(),
              absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(cache.size(), 0);
  // Nor is one that was never joined (the source refused the pull).
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
  }
  EXPECT_EQ(cache.size(), 0);
}

// The holder of a pair's communicator waits on a silent peer until its own
// deadline; the transfer waiting for the pair then gets a new one, well
// within its own deadline.
TEST_F(NcclCommCacheTest, DeadPeerUnblocksTheWaiterAtTheHoldersDeadline) {
  NcclCommCache cache(nccl_, 4);
  int64_t generation = 0;
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(Use(*lease).ok());
    generation = lease->generation();
  }
  absl::StatusOr<NcclCommCache::Lease> held = cache.Acquire("p", "e", Far());
  ASSERT_TRUE(held.ok());
  auto holder = std::async(std::launch::async, [&] {
    NcclCommCache::Lease lease = *std::move(held);
    char byte = 0;
    // Nothing is ever sent: the peer died after the pair was made.
    return lease.Recv(&byte, 1, *stream_,
                      Clock::now() + std::chrono::milliseconds(50));
  });
  AwaitState([&] { return nccl_.receiving() == 1; });
  auto waiter = std::async(std::launch::async,
                           [&] { return cache.Acquire("p", "e", Far()); });
  EXPECT_EQ(holder.get().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<NcclCommCache::Lease> next = waiter.get();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->joined());
  EXPECT_NE(next->generation(), generation);
  EXPECT_EQ(nccl_.destroyed(), 1);
  EXPECT_EQ(cache.size(), 1);
}

// Shutdown while a transfer waits on a silent peer and another waits for
// the pair: both return at once (their deadlines are an hour away).
TEST_F(NcclCommCacheTest, ShutdownAbortsTheTransferInUseAndItsWaiter) {
  NcclCommCache cache(nccl_, 4);
  absl::StatusOr<NcclCommCache::Lease> held = cache.Acquire("p", "e", Far());
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(held->Join(NcclRank::kPuller, Far()).ok());
  {
    // An idle one too.
    absl::StatusOr<NcclCommCache::Lease> idle = cache.Acquire("q", "e", Far());
    ASSERT_TRUE(idle.ok());
    ASSERT_TRUE(Use(*idle).ok());
  }
  auto holder = std::async(std::launch::async, [&] {
    NcclCommCache::Lease lease = *std::move(held);
    char byte = 0;
    return lease.Recv(&byte, 1, *stream_, Far());
  });
  AwaitState([&] { return nccl_.receiving() == 1; });
  auto waiter = std::async(std::launch::async,
                           [&] { return cache.Acquire("p", "e", Far()); });
  AwaitState([&] { return cache.waiting() == 1; });
  cache.Shutdown();
  EXPECT_EQ(holder.get().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(waiter.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(nccl_.destroyed(), 2);
  EXPECT_EQ(cache.Acquire("p", "e", Far()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.Open("puller", 1, "id-9").status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(NcclCommCacheTest, DroppedWhenThePeerGoesAway) {
  NcclCommCache cache(nccl_, 4);
  {
    absl::StatusOr<NcclCommCache::Lease> lease = cache.Acquire("p", "e", Far());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(Use(*lease).ok());
    lease->Drop();  // e.g. the source stopped answering
  }
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(nccl_.destroyed(), 1);
  absl::StatusOr<NcclCommCache::Lease> next = cache.Acquire("p", "e", Far());
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(next->joined());
}

TEST_F(NcclCommCacheTest, PeerRestartReplacesItsCommunicator) {
  NcclCommCache cache(nccl_, 4);
  {
    absl::StatusOr<NcclCommCache::Lease> lease =
        cache.Acquire("p", "epoch-1", Far());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(Use(*lease).ok());
  }
  absl::StatusOr<NcclCommCache::Lease> restarted =
      cache.Acquire("p", "epoch-2", Far());
  ASSERT_TRUE(restarted.ok());
  EXPECT_FALSE(restarted->joined());
  EXPECT_EQ(nccl_.destroyed(), 1);
  EXPECT_EQ(cache.size(), 1);
}

// The source side: one communicator per puller, named by the puller's
// generation; a new unique id replaces it.
TEST_F(NcclCommCacheTest, SourceKeepsOneCommunicatorPerPullerGeneration) {
  NcclCommCache cache(nccl_, 4);
  {
    absl::StatusOr<NcclCommCache::Lease> made = cache.Open("puller", 5, "u1");
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_FALSE(made->joined());
    EXPECT_EQ(made->unique_id(), "u1");
    ASSERT_TRUE(made->Join(NcclRank::kSource, Far()).ok());
  }
  {
    absl::StatusOr<NcclCommCache::Lease> kept = cache.Open("puller", 5, "");
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_TRUE(kept->joined());
    // Busy: a second pull of the same generation is refused, not queued.
    EXPECT_EQ(cache.Open("puller", 5, "").status().code(),
              absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(cache.Open("puller", 4, "").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.Open("stranger", 5, "").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(nccl_.joins(), 1);
  {
    absl::StatusOr<NcclCommCache::Lease> remade = cache.Open("puller", 6, "u2");
    ASSERT_TRUE(remade.ok());
    EXPECT_FALSE(remade->joined());
    EXPECT_EQ(nccl_.destroyed(), 1);  // generation 5
    ASSERT_TRUE(remade->Join(NcclRank::kSource, Far()).ok());
  }
  EXPECT_EQ(cache.Open("puller", 5, "").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(cache.Open("puller", 6, "").ok());
  EXPECT_EQ(cache.size(), 1);
}

// A puller that gave up on a generation mid-transfer sends a new one: the
// source's transfer on the old one is aborted, not left to its deadline.
TEST_F(NcclCommCacheTest, SourceReplacingAGenerationInUseAbortsIt) {
  NcclCommCache cache(nccl_, 4);
  absl::StatusOr<NcclCommCache::Lease> old = cache.Open("puller", 1, "u1");
  ASSERT_TRUE(old.ok());
  ASSERT_TRUE(old->Join(NcclRank::kSource, Far()).ok());
  auto transfer = std::async(std::launch::async, [&] {
    NcclCommCache::Lease lease = *std::move(old);
    char byte = 0;
    return lease.Recv(&byte, 1, *stream_, Far());
  });
  AwaitState([&] { return nccl_.receiving() == 1; });
  absl::StatusOr<NcclCommCache::Lease> fresh = cache.Open("puller", 2, "u2");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(transfer.get().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(fresh->Join(NcclRank::kSource, Far()).ok());
  EXPECT_EQ(nccl_.destroyed(), 1);
  EXPECT_EQ(cache.size(), 1);
}

TEST_F(NcclCommCacheTest, SingleUseCommunicatorForPullersThatKeepNone) {
  NcclCommCache cache(nccl_, 4);
  {
    absl::StatusOr<NcclCommCache::Lease> once = cache.Open("", 0, "u1");
    ASSERT_TRUE(once.ok());
    ASSERT_TRUE(once->Join(NcclRank::kSource, Far()).ok());
    EXPECT_EQ(cache.size(), 1);
  }
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(nccl_.destroyed(), 1);
  EXPECT_EQ(cache.Open("", 0, "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclCommCacheTest, MakesRoomByDroppingTheLeastRecentlyUsedIdleOne) {
  NcclCommCache cache(nccl_, 2);
  for (const char* peer : {"a", "b", "a"}) {
    absl::StatusOr<NcclCommCache::Lease> lease =
        cache.Acquire(peer, "e", Far());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(Use(*lease).ok());
  }
  // "b" is the least recently used.
  absl::StatusOr<NcclCommCache::Lease> c = cache.Acquire("c", "e", Far());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(nccl_.destroyed(), 1);
  absl::StatusOr<NcclCommCache::Lease> a = cache.Acquire("a", "e", Far());
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->joined());
  // Both in use: no room for "d" (the caller falls back to the stream).
  EXPECT_EQ(cache.Acquire("d", "e", Far()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.Open("puller", 1, "u").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.size(), 2);
}

// --- The KV path over the fake: two caches, two transfers, one pair. ---

constexpr int kLayers = 2;
constexpr size_t kTokenBytes = 2 * 4 * sizeof(float);  // 2 KV heads x 4

struct Cache {
  DeviceMemory memory;
  KvCacheView view;
};

Cache MakeCache(Device& device, int num_blocks, int block_size) {
  Cache c;
  const size_t part_bytes = num_blocks * block_size * kTokenBytes;
  c.memory = *device.Allocate(part_bytes * 2 * kLayers);
  std::memset(c.memory.data(), 0, c.memory.size_bytes());
  c.view.layout = {kLayers, 2, 4, "float32"};
  c.view.block_size = block_size;
  c.view.token_bytes = kTokenBytes;
  c.view.allocation = c.memory.buffer();
  for (int l = 0; l < kLayers; ++l) {
    c.view.keys.push_back(
        c.memory.buffer().Slice(2 * l * part_bytes, part_bytes));
    c.view.values.push_back(
        c.memory.buffer().Slice((2 * l + 1) * part_bytes, part_bytes));
  }
  return c;
}

// Tokens [first, seq.num_tokens) of every (layer, part), in that order.
std::vector<uint8_t> ReadFrom(Stream& stream, const KvCacheView& view,
                              const SequenceKv& seq, int32_t first) {
  const int32_t n = seq.num_tokens - first;
  std::vector<uint8_t> out(n * kTokenBytes * 2 * kLayers);
  size_t at = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
      EXPECT_TRUE(
          ReadKvTokens(stream, view, seq, {l, part, first, n}, out.data() + at)
              .ok());
      at += n * kTokenBytes;
    }
  }
  return out;
}

TEST_F(NcclCommCacheTest, TwoKvTransfersOverOnePair) {
  NcclCommCache source_comms(nccl_, 2);
  NcclCommCache puller_comms(nccl_, 2);
  Cache src = MakeCache(device_, 8, 4);
  Cache dst = MakeCache(device_, 4, 8);
  SequenceKv lease;
  lease.blocks = {5, 1, 7, 2};
  lease.num_tokens = 13;
  SequenceKv reserved;
  reserved.blocks = {3, 0};
  reserved.num_tokens = 13;
  for (const int first_token : {0, 5}) {
    SCOPED_TRACE(first_token);
    std::vector<uint8_t> pattern(13 * kTokenBytes);
    for (int l = 0; l < kLayers; ++l) {
      for (KvCachePart part : {KvCachePart::kKey, KvCachePart::kValue}) {
        for (size_t i = 0; i < pattern.size(); ++i) {
          pattern[i] =
              static_cast<uint8_t>(i * 7 + l * 31 + first_token +
                                   (part == KvCachePart::kKey ? 0 : 9));
        }
        ASSERT_TRUE(WriteKvTokens(*stream_, src.view, lease, {l, part, 0, 13},
                                  pattern.data())
                        .ok());
      }
    }
    // The puller's side of PullKvOverNccl, and the source's of PullKv.
    absl::StatusOr<NcclCommCache::Lease> pull =
        puller_comms.Acquire("prefill:1", "epoch", Far());
    ASSERT_TRUE(pull.ok());
    EXPECT_EQ(pull->joined(), first_token != 0);
    absl::StatusOr<NcclCommCache::Lease> serve =
        source_comms.Open("decode-process", pull->generation(),
                          pull->joined() ? "" : pull->unique_id());
    ASSERT_TRUE(serve.ok()) << serve.status();
    NcclKvParams send;
    send.device = &device_;
    send.view = &src.view;
    send.seq = &lease;
    send.num_tokens = 13;
    send.first_token = first_token;
    send.deadline = Far();
    auto sent = std::async(std::launch::async,
                           [&] { return NcclSendKv(send, *serve); });
    NcclKvParams receive = send;
    receive.view = &dst.view;
    receive.seq = &reserved;
    ASSERT_TRUE(NcclRecvKv(receive, *pull).ok());
    ASSERT_TRUE(sent.get().ok());
    EXPECT_EQ(ReadFrom(*stream_, dst.view, reserved, first_token),
              ReadFrom(*stream_, src.view, lease, first_token));
  }
  EXPECT_EQ(nccl_.joins(), 2);  // one per side, for both transfers
  EXPECT_EQ(source_comms.size(), 1);
  EXPECT_EQ(puller_comms.size(), 1);
}

}  // namespace
}  // namespace pdworker
