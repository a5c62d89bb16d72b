// KvLeaseTable's state machine: one pull per lease, a failed pull makes it
// pullable again, a release during a pull is deferred to its end, expiry
// never frees blocks under a reader, and every lease's blocks are handed
// back exactly once.
#include "worker/engine/kv_lease_table.h"

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records what the table hands back.
struct Freed {
  std::mutex mu;
  std::vector<std::vector<int32_t>> blocks;
  std::vector<std::vector<int32_t>> Take() {
    std::lock_guard<std::mutex> lock(mu);
    return blocks;
  }
};

SequenceKv Kv(std::vector<int32_t> blocks, int32_t tokens) {
  SequenceKv kv;
  kv.blocks = std::move(blocks);
  kv.num_tokens = tokens;
  return kv;
}

KvLeaseTable::FreeBlocks Recorder(Freed& freed) {
  return [&freed](SequenceKv kv) {
    std::lock_guard<std::mutex> lock(freed.mu);
    freed.blocks.push_back(kv.blocks);
  };
}

TEST(KvLeaseTableTest, OnePullThenRelease) {
  Freed freed;
  KvLeaseTable table(std::chrono::seconds(60), Recorder(freed), nullptr);
  const KvLeaseInfo a = table.Add("seq", Kv({3, 4}, 7));
  const KvLeaseInfo b = table.Add("seq", Kv({5}, 1));
  EXPECT_NE(a.lease_id, b.lease_id);
  EXPECT_EQ(a.lease_id.size(), 32u);
  EXPECT_EQ(a.num_tokens, 7);
  EXPECT_EQ(table.size(), 2);

  absl::StatusOr<KvPullGrant> grant = table.BeginPull(a.lease_id);
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_THAT(grant->kv.blocks, ElementsAre(3, 4));
  EXPECT_EQ(grant->sequence_id, "seq");
  // Concurrent second pull.
  EXPECT_EQ(table.BeginPull(a.lease_id).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Released mid-pull: deferred.
  absl::StatusOr<int32_t> released = table.Release(a.lease_id);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 0);
  EXPECT_TRUE(freed.Take().empty());
  table.EndPull(a.lease_id, /*sent_all=*/true);
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(3, 4)));
  // Gone: a late pull or release is told why.
  // Pulled in full, then released: a second pull is FAILED_PRECONDITION
  // (consumed), a second release NOT_FOUND (nothing left), as the README's
  // contract table says.
  absl::Status late = table.BeginPull(a.lease_id).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.message(), HasSubstr("already pulled"));
  EXPECT_EQ(table.Release(a.lease_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.BeginPull("nope").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.size(), 1);
}

// A lease its router releases before any pull (it gave up on the request)
// is gone: a late pull is NOT_FOUND, like an expired lease.
TEST(KvLeaseTableTest, PullAfterReleaseKvIsNotFound) {
  Freed freed;
  KvLeaseTable table(std::chrono::seconds(60), Recorder(freed), nullptr);
  const KvLeaseInfo a = table.Add("s", Kv({5, 6}, 20));
  absl::StatusOr<int32_t> released = table.Release(a.lease_id);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 2);
  absl::Status late = table.BeginPull(a.lease_id).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.message(), HasSubstr("released (ReleaseKv)"));
  // Counted as lease_not_found, not lease_expired.
  EXPECT_FALSE(SaysLeaseExpired(late.message()));
  EXPECT_EQ(table.Release(a.lease_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.size(), 0);
}

TEST(KvLeaseTableTest, FailedPullMayBeRetriedCompletedPullMayNot) {
  Freed freed;
  KvLeaseTable table(std::chrono::seconds(60), Recorder(freed), nullptr);
  const KvLeaseInfo a = table.Add("s", Kv({1}, 2));
  ASSERT_TRUE(table.BeginPull(a.lease_id).ok());
  table.EndPull(a.lease_id, /*sent_all=*/false);  // the puller went away
  ASSERT_TRUE(table.BeginPull(a.lease_id).ok());
  table.EndPull(a.lease_id, /*sent_all=*/true);
  absl::Status again = table.BeginPull(a.lease_id).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("already pulled"));
  absl::StatusOr<int32_t> released = table.Release(a.lease_id);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 1);
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(1)));
}

TEST(KvLeaseTableTest, ExpiryFreesButNeverUnderAReader) {
  Freed freed;
  KvLeaseTable table(std::chrono::milliseconds(50), Recorder(freed), nullptr);
  const KvLeaseInfo idle = table.Add("idle", Kv({1}, 1));
  const KvLeaseInfo busy = table.Add("busy", Kv({2}, 1));
  ASSERT_TRUE(table.BeginPull(busy.lease_id).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  table.ExpireDue();  // the sweeper may have done it already
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(1)));
  EXPECT_EQ(table.size(), 1);
  absl::Status late = table.BeginPull(idle.lease_id).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.message(), HasSubstr("expired"));
  // The handoff metrics tell an expiry from an unknown lease by this.
  EXPECT_TRUE(SaysLeaseExpired(late.message()));
  EXPECT_FALSE(SaysLeaseExpired(
      table.BeginPull(std::string(32, '0')).status().message()));
  // The reader finishes after the expiry: freed then.
  table.EndPull(busy.lease_id, /*sent_all=*/true);
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(1), ElementsAre(2)));
  EXPECT_EQ(table.size(), 0);
}

// Renew pushes a held (or pulling) lease's expiry to now + TTL, so it
// outlives its first TTL while renewed; a lease left alone expires on time;
// pulled, released and expired leases cannot be renewed.
TEST(KvLeaseTableTest, RenewKeepsALeaseAlivePastItsTtl) {
  Freed freed;
  // Renewals every 50 ms against a 600 ms TTL: a loaded machine may
  // deschedule this thread for half a second without breaking the test.
  constexpr auto kTtl = std::chrono::milliseconds(600);
  KvLeaseTable table(kTtl, Recorder(freed), nullptr);
  const KvLeaseInfo renewed = table.Add("renewed", Kv({1}, 3));
  const KvLeaseInfo alone = table.Add("alone", Kv({2}, 3));
  const auto start = std::chrono::system_clock::now();
  // Renew every 50 ms for 2 TTLs.
  while (std::chrono::system_clock::now() - start < 2 * kTtl) {
    absl::StatusOr<std::chrono::system_clock::time_point> expiry =
        table.Renew(renewed.lease_id);
    ASSERT_TRUE(expiry.ok()) << expiry.status();
    EXPECT_GT(*expiry, std::chrono::system_clock::now() + kTtl / 2);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    table.ExpireDue();
  }
  // The one left alone expired; the renewed one is still pullable.
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(2)));
  EXPECT_EQ(table.Renew(alone.lease_id).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(table.BeginPull(renewed.lease_id).ok());
  // Pulling: still renewable (the puller may be slow).
  EXPECT_TRUE(table.Renew(renewed.lease_id).ok());
  table.EndPull(renewed.lease_id, /*sent_all=*/true);
  const absl::Status pulled = table.Renew(renewed.lease_id).status();
  EXPECT_EQ(pulled.code(), absl::StatusCode::kFailedPrecondition) << pulled;
  EXPECT_THAT(pulled.message(), HasSubstr("already pulled"));
  ASSERT_TRUE(table.Release(renewed.lease_id).ok());
  EXPECT_EQ(table.Renew(renewed.lease_id).status().code(),
            absl::StatusCode::kFailedPrecondition);  // its tombstone
  EXPECT_EQ(table.Renew("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(KvLeaseTableTest, DestructionHandsBackWhatIsHeld) {
  Freed freed;
  {
    KvLeaseTable table(std::chrono::seconds(60), Recorder(freed), nullptr);
    table.Add("a", Kv({7, 8}, 5));
  }
  EXPECT_THAT(freed.Take(), ElementsAre(ElementsAre(7, 8)));
}

}  // namespace
}  // namespace pdworker
