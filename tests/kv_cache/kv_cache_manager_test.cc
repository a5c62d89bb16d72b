#include "worker/kv_cache/kv_cache_manager.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/kv_cache/kv_cache_spec.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

// Everything observable about the manager, to prove a failed call changed
// nothing.
struct Snapshot {
  KvCacheStats stats;
  std::map<std::string, std::pair<std::vector<int32_t>, int32_t>> seqs;
  bool operator==(const Snapshot& o) const {
    return stats.free_blocks == o.stats.free_blocks &&
           stats.used_blocks == o.stats.used_blocks &&
           stats.num_sequences == o.stats.num_sequences && seqs == o.seqs;
  }
};

Snapshot Take(const KvCacheManager& m, const std::vector<std::string>& ids) {
  Snapshot s{m.Stats(), {}};
  for (const auto& id : ids) {
    if (const SequenceKv* kv = m.Find(id)) {
      s.seqs[id] = {kv->blocks, kv->num_tokens};
    }
  }
  return s;
}

TEST(KvCacheSpecTest, BytesPerBlockAndBudget) {
  KvCacheSpec spec{/*num_layers=*/2,     /*num_kv_heads=*/4,
                   /*head_dim=*/8,
                   /*block_size=*/16,    /*dtype_bytes=*/4,
                   /*max_model_len=*/100};
  // K and V, 2 layers, 16 tokens x 4 heads x 8 dims x 4 bytes.
  EXPECT_EQ(spec.BytesPerBlock(), 2 * 2 * 16 * 4 * 8 * 4);
  EXPECT_EQ(spec.MaxBlocksPerSeq(), 7);  // ceil(100 / 16)
  auto blocks = NumBlocksForBudget(spec, 10 * spec.BytesPerBlock() + 5);
  ASSERT_TRUE(blocks.ok());
  EXPECT_EQ(*blocks, 10);

  auto too_small = NumBlocksForBudget(spec, 6 * spec.BytesPerBlock());
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_small.status().message()),
              HasSubstr("max_model_len=100"));
  spec.head_dim = 0;
  EXPECT_EQ(NumBlocksForBudget(spec, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockPoolTest, AllOrNothingAndDoubleFree) {
  BlockPool pool(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.Allocate(3, &got).ok());
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(pool.num_free(), 1);
  std::vector<int32_t> more;
  EXPECT_EQ(pool.Allocate(2, &more).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(more.empty());
  EXPECT_EQ(pool.num_free(), 1);
  pool.Free(got);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_DEATH(pool.Free({got[0]}), "double free");
}

TEST(KvCacheManagerTest, SlotsFollowBlockTable) {
  KvCacheManager m(/*num_blocks=*/8, /*block_size=*/4, /*max_model_len=*/32);
  ASSERT_TRUE(m.Append({{"a", 6}}).ok());
  const SequenceKv* a = m.Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->blocks.size(), 2u);
  EXPECT_EQ(a->num_tokens, 6);
  EXPECT_EQ(m.SlotFor(*a, 0), a->blocks[0] * 4);
  EXPECT_EQ(m.SlotFor(*a, 5), a->blocks[1] * 4 + 1);
  // Two more tokens fit in the second block: no new block.
  ASSERT_TRUE(m.Append({{"a", 2, SequenceCreation::kMustExist}}).ok());
  EXPECT_EQ(m.Find("a")->blocks.size(), 2u);
  ASSERT_TRUE(m.Append({{"a", 1, SequenceCreation::kMustExist}}).ok());
  EXPECT_EQ(m.Find("a")->blocks.size(), 3u);
  EXPECT_EQ(m.Stats().used_blocks, 3);
  ASSERT_TRUE(m.Free("a").ok());
  EXPECT_EQ(m.Stats().used_blocks, 0);
  EXPECT_EQ(m.Free("a").code(), absl::StatusCode::kNotFound);
}

TEST(KvCacheManagerTest, EveryFailureChangesNothing) {
  KvCacheManager m(/*num_blocks=*/4, /*block_size=*/4, /*max_model_len=*/12);
  ASSERT_TRUE(m.Append({{"a", 5}, {"b", 1}}).ok());  // 2 + 1 blocks
  const std::vector<std::string> ids = {"a", "b", "c", "d"};
  const Snapshot before = Take(m, ids);

  struct Case {
    std::vector<SequenceAppend> step;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"c", 1}, {"a", 4}}, absl::StatusCode::kResourceExhausted, "full"},
      {{{"c", 1}, {"c", 1}}, absl::StatusCode::kInvalidArgument, "twice"},
      {{{"c", 1}, {"", 1}}, absl::StatusCode::kInvalidArgument, "empty"},
      {{{"c", 1}, {"b", 0}}, absl::StatusCode::kInvalidArgument, "positive"},
      {{{"c", 1}, {"a", 8}},
       absl::StatusCode::kInvalidArgument,
       "max_model_len"},
      {{{"c", 1}, {"d", 1, SequenceCreation::kMustExist}},
       absl::StatusCode::kNotFound,
       "unknown"},
      {{{"c", 1}, {"a", 1, SequenceCreation::kMustBeNew}},
       absl::StatusCode::kAlreadyExists,
       "exists"},
  };
  for (const Case& c : cases) {
    auto r = m.Append(c.step);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message));
    EXPECT_TRUE(Take(m, ids) == before) << "state changed by: " << r.status();
  }
}

TEST(KvCacheManagerTest, UndoRestoresExactly) {
  KvCacheManager m(/*num_blocks=*/6, /*block_size=*/4, /*max_model_len=*/64);
  ASSERT_TRUE(m.Append({{"a", 3}}).ok());
  const std::vector<std::string> ids = {"a", "b"};
  const Snapshot before = Take(m, ids);
  auto r = m.Append({{"a", 6}, {"b", 2}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(m.Stats().used_blocks, 4);
  m.Undo(*r);
  EXPECT_TRUE(Take(m, ids) == before);
  EXPECT_EQ(m.Find("b"), nullptr);
}

TEST(KvCacheManagerTest, TruncateFreesTrailingBlocks) {
  KvCacheManager m(/*num_blocks=*/6, /*block_size=*/4, /*max_model_len=*/64);
  ASSERT_TRUE(m.Append({{"a", 3}}).ok());
  const std::vector<std::string> ids = {"a"};
  const Snapshot before = Take(m, ids);
  ASSERT_TRUE(m.Append({{"a", 6, SequenceCreation::kMustExist}}).ok());
  ASSERT_TRUE(m.Append({{"a", 4, SequenceCreation::kMustExist}}).ok());
  EXPECT_EQ(m.Stats().used_blocks, 4);  // 13 tokens

  // Errors change nothing.
  const Snapshot grown = Take(m, ids);
  EXPECT_EQ(m.Truncate("a", 14).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Truncate("a", -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Truncate("b", 0).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Take(m, ids) == grown);

  // Back to 3 tokens: exactly the state before the two appends.
  ASSERT_TRUE(m.Truncate("a", 3).ok());
  EXPECT_TRUE(Take(m, ids) == before);
  ASSERT_TRUE(m.Truncate("a", 0).ok());
  EXPECT_EQ(m.Find("a")->num_tokens, 0);
  EXPECT_EQ(m.Stats().used_blocks, 0);
  EXPECT_EQ(m.Stats().num_sequences, 1);
}

// The handoff primitives: a prefill lease is a detached sequence, a decode
// import allocates detached blocks and attaches them under an id.
// Every layer slides over 8 tokens: blocks no later query can see go back
// to the pool, their entries kFreedBlock; Free returns the rest; the
// sequence can no longer be detached (its KV is not whole) or truncated.
TEST(KvCacheManagerTest, FreeOutsideWindowGivesBackDeadBlocksOnly) {
  KvCacheManager m(/*num_blocks=*/8, /*block_size=*/4, /*max_model_len=*/64);
  ASSERT_TRUE(m.Append({{"a", 20}}).ok());  // blocks 0-4
  ASSERT_TRUE(m.Append({{"b", 3}}).ok());
  EXPECT_EQ(m.Stats().used_blocks, 6);
  // The next query (position 20) sees positions 13..20: blocks 0-2 (0..11)
  // are dead, block 3 (12..15) is not.
  auto freed = m.FreeOutsideWindow("a", 8);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 3);
  const SequenceKv* a = m.Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->num_tokens, 20);
  ASSERT_EQ(a->blocks.size(), 5u);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(a->blocks[b], kFreedBlock) << b;
  EXPECT_NE(a->blocks[3], kFreedBlock);
  EXPECT_EQ(m.Stats().used_blocks, 3);
  // Again: nothing more is dead.
  EXPECT_EQ(*m.FreeOutsideWindow("a", 8), 0);
  // Appending goes on at the tail; the new blocks come from the pool.
  ASSERT_TRUE(m.Append({{"a", 5, SequenceCreation::kMustExist}}).ok());
  EXPECT_EQ(m.Find("a")->blocks.size(), 7u);
  EXPECT_EQ(m.SlotFor(*m.Find("a"), 24) / 4, m.Find("a")->blocks[6]);
  // A short sequence has nothing to give back.
  EXPECT_EQ(*m.FreeOutsideWindow("b", 8), 0);

  EXPECT_EQ(m.Detach("a").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.Truncate("a", 20).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(m.Truncate("a", 25).ok()) << "no cut: nothing to refuse";
  EXPECT_EQ(m.FreeOutsideWindow("a", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.FreeOutsideWindow("zz", 8).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(m.Free("a").ok());
  ASSERT_TRUE(m.Free("b").ok());
  EXPECT_EQ(m.Stats().used_blocks, 0);
  EXPECT_EQ(m.Stats().free_blocks, 8);
}

TEST(KvCacheManagerTest, DetachAttachKeepsBlocksAndCountsThem) {
  KvCacheManager m(/*num_blocks=*/6, /*block_size=*/4, /*max_model_len=*/16);
  ASSERT_TRUE(m.Append({{"a", 9}}).ok());  // 3 blocks
  const std::vector<int32_t> blocks = m.Find("a")->blocks;

  absl::StatusOr<SequenceKv> lease = m.Detach("a");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->blocks, blocks);
  EXPECT_EQ(lease->num_tokens, 9);
  EXPECT_EQ(m.Find("a"), nullptr);      // the id is free again ...
  EXPECT_EQ(m.Stats().used_blocks, 3);  // ... the blocks are not
  EXPECT_EQ(m.Stats().detached_blocks, 3);
  EXPECT_EQ(m.Stats().num_sequences, 0);
  EXPECT_EQ(m.Detach("a").status().code(), absl::StatusCode::kNotFound);

  // A new "a" does not get the held blocks.
  ASSERT_TRUE(m.Append({{"a", 4}}).ok());
  for (int32_t b : m.Find("a")->blocks) {
    EXPECT_EQ(std::count(blocks.begin(), blocks.end(), b), 0);
  }

  // Import side: all-or-nothing allocation, then attach under an id.
  EXPECT_EQ(m.AllocateDetached(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.AllocateDetached(17).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.AllocateDetached(9).status().code(),  // 3 > 2 free
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.Stats().free_blocks, 2);
  absl::StatusOr<SequenceKv> import = m.AllocateDetached(5);
  ASSERT_TRUE(import.ok()) << import.status();
  EXPECT_EQ(import->blocks.size(), 2u);
  EXPECT_EQ(m.Stats().detached_blocks, 5);

  // A live id refuses the attach and the caller keeps the blocks.
  EXPECT_EQ(m.Attach("a", *import).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(import->blocks.size(), 2u);
  ASSERT_TRUE(m.Attach("b", *import).ok());
  EXPECT_TRUE(import->blocks.empty());
  EXPECT_EQ(m.Find("b")->num_tokens, 5);
  EXPECT_EQ(m.Stats().detached_blocks, 3);
  // The attached sequence grows like any other.
  ASSERT_TRUE(m.Append({{"b", 3, SequenceCreation::kMustExist}}).ok());
  EXPECT_EQ(m.Find("b")->num_tokens, 8);

  m.FreeDetached(*lease);
  EXPECT_TRUE(lease->blocks.empty());
  EXPECT_EQ(m.Stats().detached_blocks, 0);
  ASSERT_TRUE(m.Free("a").ok());
  ASSERT_TRUE(m.Free("b").ok());
  EXPECT_EQ(m.Stats().free_blocks, 6);
}

// The idle sweep's view: a sequence is active from the step that last
// appended to it (or the import that installed it); detached KV is never
// listed. Sleeps order the time points; no assertion depends on how long.
TEST(KvCacheManagerTest, IdleSinceListsSequencesNotStepped) {
  using Clock = std::chrono::steady_clock;
  const auto tick = [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  KvCacheManager m(/*num_blocks=*/8, /*block_size=*/4, /*max_model_len=*/16);
  const Clock::time_point before = Clock::now();
  tick();
  ASSERT_TRUE(m.Append({{"a", 3}, {"b", 3}, {"c", 3}}).ok());
  EXPECT_THAT(m.IdleSince(before), ::testing::IsEmpty());
  tick();
  const Clock::time_point after_first = Clock::now();
  EXPECT_THAT(m.IdleSince(after_first), ::testing::ElementsAre("a", "b", "c"));

  tick();
  ASSERT_TRUE(m.Append({{"b", 1, SequenceCreation::kMustExist}}).ok());
  EXPECT_THAT(m.IdleSince(after_first), ::testing::ElementsAre("a", "c"));

  // A step that fails (KV full) touches nothing.
  tick();
  const Clock::time_point before_failure = Clock::now();
  ASSERT_EQ(m.Append({{"a", 14, SequenceCreation::kMustExist}}).status().code(),
            absl::StatusCode::kInvalidArgument);  // past max_model_len
  EXPECT_THAT(m.IdleSince(before_failure),
              ::testing::ElementsAre("a", "b", "c"));

  // Detached (a lease) is not listed; attached (an import) is fresh.
  absl::StatusOr<SequenceKv> lease = m.Detach("c");
  ASSERT_TRUE(lease.ok());
  tick();
  const Clock::time_point before_attach = Clock::now();
  absl::StatusOr<SequenceKv> import = m.AllocateDetached(4);
  ASSERT_TRUE(import.ok());
  EXPECT_THAT(m.IdleSince(Clock::now()), ::testing::ElementsAre("a", "b"));
  tick();
  ASSERT_TRUE(m.Attach("d", *import).ok());
  EXPECT_THAT(m.IdleSince(before_attach), ::testing::ElementsAre("a", "b"));
  ASSERT_TRUE(m.Free("a").ok());
  EXPECT_THAT(m.IdleSince(Clock::now() + std::chrono::hours(1)),
              ::testing::ElementsAre("b", "d"));
  m.FreeDetached(*lease);
}

// 10,000 random allocate/append/free/undo operations against a shadow model
// that tracks only lengths. Invariants after every operation: each sequence
// holds exactly ceil(len / block_size) blocks, no block is owned twice, and
// used blocks equal the sum over sequences. At the end, freeing everything
// returns every block: nothing leaked.
TEST(KvCacheManagerTest, RandomOperationsNeverLeak) {
  constexpr int32_t kBlocks = 64, kBlockSize = 4, kMaxLen = 40;
  KvCacheManager m(kBlocks, kBlockSize, kMaxLen);
  std::mt19937 rng(12345);
  std::map<std::string, int32_t> shadow;  // id -> length
  std::vector<std::string> names;
  for (int i = 0; i < 24; ++i) names.push_back("s" + std::to_string(i));
  int ok_steps = 0, failed_steps = 0;

  for (int op = 0; op < 10000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 2 && !shadow.empty()) {  // free one
      auto it = shadow.begin();
      std::advance(it, rng() % shadow.size());
      ASSERT_TRUE(m.Free(it->first).ok());
      shadow.erase(it);
    } else {  // a step over 1..4 sequences; sometimes undone
      std::vector<std::string> ids;
      std::vector<SequenceAppend> step;
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) ids.push_back(names[rng() % names.size()]);
      for (const auto& id : ids) {
        step.push_back({id, 1 + static_cast<int32_t>(rng() % 9)});
      }
      // Predict the outcome independently, from the shadow model.
      const int32_t free_before = m.Stats().free_blocks;
      std::set<std::string> uniq(ids.begin(), ids.end());
      bool expect_ok = uniq.size() == ids.size();
      int64_t need = 0;
      for (const auto& a : step) {
        auto it = shadow.find(std::string(a.sequence_id));
        const int32_t cur = it == shadow.end() ? 0 : it->second;
        if (cur + a.num_new_tokens > kMaxLen) expect_ok = false;
        need += (cur + a.num_new_tokens + kBlockSize - 1) / kBlockSize -
                (cur + kBlockSize - 1) / kBlockSize;
      }
      if (need > free_before) expect_ok = false;
      auto r = m.Append(step);
      ASSERT_EQ(r.ok(), expect_ok)
          << r.status() << " need=" << need << " free=" << free_before;
      if (!r.ok()) {
        ++failed_steps;
        ASSERT_EQ(m.Stats().free_blocks, free_before);
        continue;
      }
      ++ok_steps;
      if (rng() % 5 == 0) {
        m.Undo(*r);
      } else {
        for (const auto& a : step) {
          shadow[std::string(a.sequence_id)] += a.num_new_tokens;
        }
      }
    }
    // Invariants.
    std::set<int32_t> owned;
    int32_t used = 0;
    for (const auto& [id, len] : shadow) {
      const SequenceKv* kv = m.Find(id);
      ASSERT_NE(kv, nullptr) << id;
      ASSERT_EQ(kv->num_tokens, len);
      ASSERT_EQ(static_cast<int32_t>(kv->blocks.size()),
                (len + kBlockSize - 1) / kBlockSize);
      for (int32_t b : kv->blocks) ASSERT_TRUE(owned.insert(b).second) << b;
      used += static_cast<int32_t>(kv->blocks.size());
    }
    ASSERT_EQ(m.Stats().used_blocks, used);
    ASSERT_EQ(m.Stats().num_sequences, static_cast<int32_t>(shadow.size()));
  }
  EXPECT_GT(ok_steps, 1000);
  EXPECT_GT(failed_steps, 100);  // exhaustion and limits were exercised
  for (const auto& [id, len] : shadow) ASSERT_TRUE(m.Free(id).ok());
  EXPECT_EQ(m.Stats().free_blocks, kBlocks);
}

}  // namespace
}  // namespace pdworker
