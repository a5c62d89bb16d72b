// WorkerPool against real in-process workers: least-loaded picking (most
// free KV blocks, then fewest sequences), skipping workers that fail
// GetStatus or do not serve, the status cache, and spreading a burst by
// counting its own placements.
#include "tools/router/worker_pool.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/router_test_util.h"
#include "tests/server/server_test_util.h"

namespace pdworker::router {
namespace {

using router_testing::Address;
using router_testing::Prompt;
using router_testing::StartRoleWorker;
using server_testing::Forward;
using server_testing::Input;
using server_testing::Request;
using server_testing::TestWorker;
using ::testing::HasSubstr;

// Refreshes in the background on every pick; the first pick (and the first
// after Invalidate) waits for fresh answers.
WorkerPoolOptions Uncached() {
  WorkerPoolOptions options;
  options.status_ttl = std::chrono::milliseconds(0);
  options.failure_backoff = std::chrono::milliseconds(0);
  return options;
}

// Never refreshes within a test.
WorkerPoolOptions Cached() {
  WorkerPoolOptions options;
  options.status_ttl = std::chrono::seconds(600);
  return options;
}

class WorkerPoolTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    a_ = StartRoleWorker(Role::kBoth).release();
    b_ = StartRoleWorker(Role::kBoth).release();
  }
  static void TearDownTestSuite() {
    delete a_;
    delete b_;
  }
  void SetUp() override {
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
  }
  void TearDown() override {
    for (const std::string& id : live_) {
      for (TestWorker* w : {a_, b_}) {
        grpc::ClientContext context;
        server_testing::SetGenerousDeadline(&context);
        v1::ReleaseRequest r;
        r.add_sequence_ids(id);
        v1::ReleaseResponse response;
        (void)w->stub->Release(&context, r, &response);
      }
    }
    router_testing::ExpectIdle(*a_, "a");
    router_testing::ExpectIdle(*b_, "b");
  }

  // Starts a sequence of `tokens` prompt tokens on `w` and keeps it live.
  void Hold(TestWorker& w, const std::string& id, int tokens) {
    v1::ForwardResponse response;
    const grpc::Status status = Forward(
        *w.stub, Request({Input(id, Prompt(tokens, 1), true)}), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    live_.push_back(id);
  }

  std::unique_ptr<WorkerPool> Pool(const std::vector<std::string>& addresses,
                                   const WorkerPoolOptions& options) {
    auto pool = WorkerPool::Create(addresses, options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *std::move(pool) : nullptr;
  }

  static TestWorker* a_;
  static TestWorker* b_;
  std::vector<std::string> live_;
};

TestWorker* WorkerPoolTest::a_ = nullptr;
TestWorker* WorkerPoolTest::b_ = nullptr;

TEST_F(WorkerPoolTest, PicksTheWorkerWithMostFreeBlocks) {
  auto pool = Pool({Address(*a_), Address(*b_)}, Uncached());
  ASSERT_NE(pool, nullptr);
  Hold(*a_, "big-on-a", 40);  // 10 blocks of 4
  auto picked = pool->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*b_));

  Hold(*b_, "bigger-on-b", 60);  // 15 blocks: now a has more free
  pool->Invalidate();            // don't race the background refresh
  picked = pool->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*a_));
}

TEST_F(WorkerPoolTest, APreferredPickCountsOnlyTheBlocksPastItsCachedPrefix) {
  // One status round: the placements alone tell the workers apart.
  auto pool = Pool({Address(*a_), Address(*b_)}, Cached());
  ASSERT_NE(pool, nullptr);
  // 40 tokens, 32 of them cached on a: a allocates 2 blocks, not 10.
  const std::vector<int32_t> cached_on_a = {32, 0};
  auto picked = pool->PickLeastLoaded(/*expected_tokens=*/40, cached_on_a);
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*a_));
  picked = pool->PickLeastLoaded(/*expected_tokens=*/16);  // 4 blocks
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*b_));
  // a is 2 blocks down, b 4: a (had the cached prefix counted, b).
  picked = pool->PickLeastLoaded(/*expected_tokens=*/4);
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*a_));
}

TEST_F(WorkerPoolTest, EqualFreeBlocksPicksFewerSequences) {
  auto pool = Pool({Address(*a_), Address(*b_)}, Uncached());
  ASSERT_NE(pool, nullptr);
  // 2 blocks each: a in two sequences, b in one.
  Hold(*a_, "a1", 4);
  Hold(*a_, "a2", 4);
  Hold(*b_, "b1", 8);
  ASSERT_EQ(a_->Status().kv_blocks_free(), b_->Status().kv_blocks_free());
  auto picked = pool->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*b_));
}

TEST_F(WorkerPoolTest, ABurstSpreadsOverIdleWorkers) {
  // One status round for the whole burst: only the pool's own placements
  // tell the workers apart.
  auto pool = Pool({Address(*a_), Address(*b_)}, Cached());
  ASSERT_NE(pool, nullptr);
  std::vector<std::string> picks;
  for (int i = 0; i < 6; ++i) {
    auto picked = pool->PickLeastLoaded(/*expected_tokens=*/16);
    ASSERT_TRUE(picked.ok()) << picked.status();
    picks.push_back((*picked)->address);
  }
  EXPECT_THAT(picks,
              ::testing::ElementsAre(Address(*a_), Address(*b_), Address(*a_),
                                     Address(*b_), Address(*a_), Address(*b_)));
}

TEST_F(WorkerPoolTest, StatusIsCachedUntilStaleOrInvalidated) {
  auto pool = Pool({Address(*a_)}, Cached());
  ASSERT_NE(pool, nullptr);
  auto before = pool->Status(0);
  ASSERT_TRUE(before.ok()) << before.status();
  Hold(*a_, "seq", 8);
  auto cached = pool->Status(0);
  ASSERT_TRUE(cached.ok());
  EXPECT_EQ(cached->num_sequences(), before->num_sequences());
  pool->Invalidate();
  auto fresh = pool->Status(0);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->num_sequences(), before->num_sequences() + 1);
  EXPECT_EQ(fresh->kv_blocks_free(), before->kv_blocks_free() - 2);
}

TEST_F(WorkerPoolTest, SkipsUnreachableWorkers) {
  // Nothing listens on port 1.
  auto pool = Pool({"127.0.0.1:1", Address(*a_)}, Uncached());
  ASSERT_NE(pool, nullptr);
  auto picked = pool->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*a_));

  auto dead = Pool({"127.0.0.1:1"}, Uncached());
  ASSERT_NE(dead, nullptr);
  auto none = dead->PickLeastLoaded();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(none.status().message(), HasSubstr("127.0.0.1:1"));
}

TEST_F(WorkerPoolTest, SkipsWorkersThatAreNotServing) {
  // Listening, but graphs not captured: serving=false.
  std::unique_ptr<TestWorker> starting = server_testing::StartWorker(
      router_testing::RunnerOptions(Role::kBoth), {},
      /*capture_and_serve=*/false);
  ASSERT_NE(starting, nullptr);
  auto pool = Pool({Address(*starting), Address(*a_)}, Uncached());
  ASSERT_NE(pool, nullptr);
  auto picked = pool->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*a_));

  auto only = Pool({Address(*starting)}, Uncached());
  ASSERT_NE(only, nullptr);
  auto none = only->PickLeastLoaded();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(none.status().message(), HasSubstr("not serving"));

  // Serving now. The cache still says "not serving", so the pick waits for
  // the refresh it started instead of failing on the old answer.
  ASSERT_TRUE(starting->server->CaptureGraphsAndServe().ok());
  picked = only->PickLeastLoaded();
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ((*picked)->address, Address(*starting));
}

// A caller refused by a worker asks again: the fresh answer replaces the
// cached one at once (no waiting out status_ttl), and picks skip the
// worker from then on.
TEST_F(WorkerPoolTest, RecheckReplacesTheCachedAnswer) {
  std::unique_ptr<TestWorker> draining = StartRoleWorker(Role::kBoth);
  ASSERT_NE(draining, nullptr);
  auto pool = Pool({Address(*draining), Address(*a_)}, Cached());
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->Status(0).ok());
  EXPECT_TRUE(pool->Recheck(0));  // serving

  draining->server->BeginDrain();
  ASSERT_TRUE(pool->Status(0)->serving());  // cached for 10 minutes
  EXPECT_FALSE(pool->Recheck(0));
  EXPECT_FALSE(pool->Status(0)->serving());
  for (int i = 0; i < 3; ++i) {
    auto picked = pool->PickLeastLoaded();
    ASSERT_TRUE(picked.ok()) << picked.status();
    EXPECT_EQ((*picked)->address, Address(*a_));
  }

  // Gone altogether: the failure is cached and the worker skipped.
  draining->server->Drain();
  EXPECT_FALSE(pool->Recheck(0));
  EXPECT_FALSE(pool->Status(0).ok());
}

TEST(WorkerPoolCreateTest, RejectsBadAddressLists) {
  EXPECT_EQ(WorkerPool::Create({}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerPool::Create({""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerPool::Create({"127.0.0.1:5", "127.0.0.1:5"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker::router
