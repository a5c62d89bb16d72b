// Prefix caching in the KvCacheManager: hashing, sharing, eviction, events,
// and a randomized run against a shadow model of what each slot holds.
#include <openssl/sha.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/kv_cache/block_hash.h"
#include "worker/kv_cache/kv_cache_manager.h"

namespace pdworker {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int32_t kBs = 4;

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> v;
  for (int32_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

std::vector<int32_t> Concat(std::vector<int32_t> a,
                            const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

KvCacheManager Caching(int32_t num_blocks, std::string salt = "model-a") {
  return KvCacheManager(num_blocks, kBs, /*max_model_len=*/256,
                        {PrefixCaching::kOn, std::move(salt)});
}

// Appends `ids` to `id` in one step; returns the entry's cached tokens.
int32_t Step(KvCacheManager& m, const std::string& id,
             const std::vector<int32_t>& ids,
             SequenceCreation creation = SequenceCreation::kCreateIfMissing) {
  absl::StatusOr<StepReservation> r =
      m.Append({{id, static_cast<int32_t>(ids.size()), creation, ids}});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->entries[0].cached_tokens : -1;
}

std::vector<KvCacheEvent> Events(KvCacheManager& m) {
  std::vector<KvCacheEvent> events;
  m.TakeEvents(&events);
  return events;
}

TEST(BlockHashTest, IsTheDocumentedSha256Chain) {
  const BlockHasher hasher("salt", kBs);
  const std::string root_text =
      std::string("pdworker-prefix-cache-v1") + std::string(1, '\0') + "salt";
  BlockHash root;
  SHA256(reinterpret_cast<const unsigned char*>(root_text.data()),
         root_text.size(), root.data());
  EXPECT_EQ(hasher.root(), root);
  // Block 0 = SHA-256(root || ids as little-endian int32).
  const std::vector<int32_t> ids = {1, 2, 3, 0x01020304};
  unsigned char buf[32 + 16];
  std::memcpy(buf, root.data(), 32);
  for (int i = 0; i < 4; ++i) {
    for (int byte = 0; byte < 4; ++byte) {
      buf[32 + 4 * i + byte] = (static_cast<uint32_t>(ids[i]) >> (8 * byte));
    }
  }
  BlockHash expected;
  SHA256(buf, sizeof(buf), expected.data());
  EXPECT_EQ(hasher.Hash(root, ids), expected);
  uint64_t external = 0;
  for (int i = 0; i < 8; ++i) external = (external << 8) | expected[i];
  EXPECT_EQ(BlockHasher::External(expected), external);
}

TEST(BlockHashTest, ChainsPrefixAndSalt) {
  const BlockHasher a("model-a", kBs), b("model-b", kBs);
  std::vector<BlockHash> x, y, z;
  a.HashFullBlocks(Range(0, 10), &x);  // 2 full blocks
  ASSERT_EQ(x.size(), 2u);
  a.HashFullBlocks(Concat(Range(100, 104), Range(4, 8)), &y);
  // Same second block, other first block: other second hash.
  EXPECT_NE(x[1], y[1]);
  b.HashFullBlocks(Range(0, 8), &z);
  EXPECT_NE(x[0], z[0]);
  // Incremental hashing continues the chain.
  std::vector<BlockHash> w;
  a.HashFullBlocks(Range(0, 4), &w);
  a.HashFullBlocks(Range(0, 8), &w);
  EXPECT_EQ(w, x);
}

TEST(PrefixCacheTest, SharesFullBlocksAndComputesTheLastToken) {
  KvCacheManager m = Caching(16);
  EXPECT_EQ(Step(m, "a", Range(0, 10)), 0);  // blocks 0,1 full, 2 partial
  EXPECT_EQ(m.Stats().cached_blocks, 2);
  // 10 tokens with the same first 8: both full blocks hit.
  EXPECT_EQ(Step(m, "b", Concat(Range(0, 8), {50, 51})), 8);
  const SequenceKv* a = m.Find("a");
  const SequenceKv* b = m.Find("b");
  EXPECT_EQ(b->blocks[0], a->blocks[0]);
  EXPECT_EQ(b->blocks[1], a->blocks[1]);
  EXPECT_NE(b->blocks[2], a->blocks[2]);
  EXPECT_EQ(b->num_tokens, 10);
  // Exactly 8 tokens: the last one is computed, so only block 0 is reused.
  EXPECT_EQ(Step(m, "c", Range(0, 8)), 4);
  EXPECT_EQ(m.Find("c")->blocks[0], a->blocks[0]);
  EXPECT_NE(m.Find("c")->blocks[1], a->blocks[1]);
  // A different first token shares nothing.
  EXPECT_EQ(Step(m, "d", Concat({99}, Range(1, 10))), 0);
  // An existing sequence never looks up.
  EXPECT_EQ(Step(m, "a", Range(10, 20), SequenceCreation::kMustExist), 0);
  const KvCacheStats s = m.Stats();
  EXPECT_EQ(s.query_tokens, 10 + 10 + 8 + 10);
  EXPECT_EQ(s.hit_tokens, 8 + 4);
  // Another salt (model) never matches.
  KvCacheManager other = Caching(16, "model-b");
  Step(other, "a", Range(0, 10));
  std::vector<BlockHash> hashes;
  other.hasher().HashFullBlocks(Range(0, 10), &hashes);
  EXPECT_EQ(m.Lookup(hashes, 10).num_blocks, 0);
}

// computed_tail_tokens = n (a step that samples after each of its last n
// tokens): those n are never taken from the cache.
TEST(PrefixCacheTest, TheComputedTailStaysOutOfTheHit) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 13));  // blocks 0-2 full and cached
  auto step = [&m](const std::string& id, int32_t tail) {
    const std::vector<int32_t> ids = Range(0, 13);
    SequenceAppend a{id, 13, SequenceCreation::kMustBeNew, ids, tail};
    absl::StatusOr<StepReservation> r = m.Append({a});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->entries[0].cached_tokens : -1;
  };
  EXPECT_EQ(step("b", 1), 12);  // the last token only
  EXPECT_EQ(step("c", 2), 8);   // tokens 11 and 12 computed: block 2 is not
  EXPECT_EQ(step("d", 5), 8);
  EXPECT_EQ(step("e", 6), 4);
  EXPECT_EQ(step("f", 13), 0);
  const std::vector<int32_t> ids = Range(0, 13);
  for (const int32_t bad : {0, 14}) {
    absl::StatusOr<StepReservation> r =
        m.Append({{"g", 13, SequenceCreation::kMustBeNew, ids, bad}});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("computed_tail_tokens"));
    EXPECT_EQ(m.Find("g"), nullptr);
  }
}

TEST(PrefixCacheTest, OffSharesNothingAndRecordsNothing) {
  KvCacheManager m(16, kBs, 256);
  EXPECT_EQ(Step(m, "a", Range(0, 10)), 0);
  EXPECT_EQ(Step(m, "b", Range(0, 10)), 0);
  EXPECT_NE(m.Find("a")->blocks[0], m.Find("b")->blocks[0]);
  EXPECT_EQ(m.Stats().cached_blocks, 0);
  EXPECT_TRUE(Events(m).empty());
  EXPECT_EQ(*m.StartSequence("c", Range(0, 10)), 0);
}

TEST(PrefixCacheTest, FreedBlocksStayCachedUntilEvictedTailFirst) {
  KvCacheManager m = Caching(4);
  Step(m, "a", Range(0, 12));  // 3 full blocks
  Events(m);
  ASSERT_TRUE(m.Free("a").ok());
  KvCacheStats s = m.Stats();
  EXPECT_EQ(s.free_blocks, 4);
  EXPECT_EQ(s.cached_blocks, 3);
  // 8 new tokens need 2 blocks: the never-cached block, then the least
  // recently freed cached one: a's tail (block 2 of a).
  Step(m, "x", Range(200, 208));
  s = m.Stats();
  EXPECT_EQ(s.evictions, 1);
  std::vector<KvCacheEvent> events = Events(m);
  ASSERT_GE(events.size(), 1u);
  const auto* removed = std::get_if<BlockRemovedEvent>(&events[0]);
  ASSERT_NE(removed, nullptr);
  std::vector<BlockHash> hashes;
  m.hasher().HashFullBlocks(Range(0, 12), &hashes);
  EXPECT_THAT(removed->block_hashes,
              ElementsAre(BlockHasher::External(hashes[2])));
  // a's first two blocks still hit.
  EXPECT_EQ(m.Lookup(hashes, 12).num_blocks, 2);
  EXPECT_EQ(m.Lookup(hashes, 12).num_held_blocks, 0);
  ASSERT_TRUE(m.Free("x").ok());
  EXPECT_EQ(Step(m, "b", Range(0, 9)), 8);
}

// With prefix caching, blocks that left the window are freed once hashed
// and stay cached: a new sequence with the same prompt takes them back.
TEST(PrefixCacheTest, BlocksFreedOutsideTheWindowStayCached) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 20));  // 5 full blocks, all hashed
  auto freed = m.FreeOutsideWindow("a", 8);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 3);
  EXPECT_EQ(m.Stats().cached_blocks, 5);
  EXPECT_EQ(m.Stats().used_blocks, 2);
  // b's prompt shares a's first 16 tokens: all four blocks hit, the three
  // freed ones back from the free pool.
  EXPECT_EQ(Step(m, "b", Concat(Range(0, 16), {900, 901})), 16);
  EXPECT_EQ(m.Stats().used_blocks, 2 + 3 + 1);
  // An unknown token stops the hashing at its block: that block is kept.
  Step(m, "c",
       Concat(Range(100, 104),
              {kUnknownTokenId, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(*m.FreeOutsideWindow("c", 4), 1);
  EXPECT_NE(m.Find("c")->blocks[1], kFreedBlock);
}

TEST(PrefixCacheTest, HitsOnFreeBlocksCountAgainstTheFreePool) {
  KvCacheManager m = Caching(3);
  Step(m, "a", Range(0, 8));  // 2 blocks, both cached
  ASSERT_TRUE(m.Free("a").ok());
  // 9 tokens: 2 hit blocks (free, cached) + 1 new = all 3 blocks.
  EXPECT_EQ(Step(m, "b", Range(0, 9)), 8);
  EXPECT_EQ(m.Stats().free_blocks, 0);
  // Nothing left: a new sequence is refused and changes nothing.
  absl::StatusOr<StepReservation> r =
      m.Append({{"c", 1, SequenceCreation::kMustBeNew, {7}}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.Find("c"), nullptr);
}

TEST(PrefixCacheTest, BlockStoredEventsCarryParentsAndTokens) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 6));  // block 0
  std::vector<KvCacheEvent> events = Events(m);
  ASSERT_EQ(events.size(), 1u);
  std::vector<BlockHash> hashes;
  m.hasher().HashFullBlocks(Range(0, 12), &hashes);
  const auto& first = std::get<BlockStoredEvent>(events[0]);
  EXPECT_THAT(first.block_hashes,
              ElementsAre(BlockHasher::External(hashes[0])));
  EXPECT_FALSE(first.parent_block_hash.has_value());
  EXPECT_THAT(first.token_ids, ElementsAreArray(Range(0, 4)));
  EXPECT_EQ(first.block_size, kBs);
  Step(m, "a", Range(6, 12), SequenceCreation::kMustExist);  // blocks 1, 2
  events = Events(m);
  ASSERT_EQ(events.size(), 1u);
  const auto& next = std::get<BlockStoredEvent>(events[0]);
  EXPECT_THAT(next.block_hashes, ElementsAre(BlockHasher::External(hashes[1]),
                                             BlockHasher::External(hashes[2])));
  EXPECT_EQ(next.parent_block_hash, BlockHasher::External(hashes[0]));
  EXPECT_THAT(next.token_ids, ElementsAreArray(Range(4, 12)));
  // A second sequence computing the same blocks concurrently (same step)
  // keeps its copies private: no event.
  ASSERT_TRUE(
      m.Append({{"p", 5, SequenceCreation::kMustBeNew, {90, 91, 92, 93, 94}},
                {"q", 5, SequenceCreation::kMustBeNew, {90, 91, 92, 93, 94}}})
          .ok());
  events = Events(m);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_NE(m.Find("p")->blocks[0], m.Find("q")->blocks[0]);
  m.ClearPrefixCache();
  events = Events(m);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<AllBlocksClearedEvent>(events[0]));
  EXPECT_EQ(m.Stats().cached_blocks, 0);
  EXPECT_EQ(Step(m, "b", Range(0, 12)), 0);
}

TEST(PrefixCacheTest, UndoUncachesWhatTheStepCached) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 4));
  Events(m);
  absl::StatusOr<StepReservation> r =
      m.Append({{"b", 9, SequenceCreation::kMustBeNew, Range(0, 9)},
                {"a", 4, SequenceCreation::kMustExist, Range(4, 8)}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->entries[0].cached_tokens, 4);
  // a0 and b1; a1 holds b1's tokens, so it stays private.
  EXPECT_EQ(m.Stats().cached_blocks, 2);
  m.Undo(*r);
  EXPECT_EQ(m.Stats().cached_blocks, 1);
  EXPECT_EQ(m.Find("b"), nullptr);
  EXPECT_EQ(m.Find("a")->num_tokens, 4);
  EXPECT_EQ(m.Stats().used_blocks, 1);
  std::vector<KvCacheEvent> events = Events(m);
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(std::holds_alternative<BlockRemovedEvent>(events.back()));
  // a's block 0 is still shared.
  EXPECT_EQ(Step(m, "c", Range(0, 6)), 4);
}

TEST(PrefixCacheTest, UnknownTokensAreCachedOnceKnown) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 3));
  // Token 3 is sampled by a step in flight.
  ASSERT_TRUE(
      m.Append({{"a", 1, SequenceCreation::kMustExist, {kUnknownTokenId}}})
          .ok());
  EXPECT_EQ(m.Stats().cached_blocks, 0);
  m.SetTokenId("a", 3, 3);
  EXPECT_EQ(m.Stats().cached_blocks, 1);
  EXPECT_EQ(Step(m, "b", Range(0, 5)), 4);
  // Unknown ids never hash; later ones are set by position only once.
  m.SetTokenId("a", 3, 77);
  EXPECT_EQ(m.Find("a")->token_ids[3], 3);
}

TEST(PrefixCacheTest, TruncateIntoASharedBlockCopiesIt) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 6));
  Step(m, "b", Range(0, 6));  // shares a's block 0
  const int32_t shared = m.Find("a")->blocks[0];
  ASSERT_EQ(m.Find("b")->blocks[0], shared);
  std::optional<BlockCopy> copy;
  // Without a way to copy, refused and unchanged.
  EXPECT_EQ(m.Truncate("a", 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.Find("a")->num_tokens, 6);
  ASSERT_TRUE(m.Truncate("a", 2, &copy).ok());
  ASSERT_TRUE(copy.has_value());
  EXPECT_EQ(copy->src_block, shared);
  EXPECT_EQ(copy->num_tokens, 2);
  EXPECT_EQ(m.Find("a")->blocks, std::vector<int32_t>{copy->dst_block});
  EXPECT_EQ(m.Find("b")->blocks[0], shared);
  // b's block is still cached; a's copy is not.
  EXPECT_EQ(Step(m, "c", Range(0, 5)), 4);
  EXPECT_EQ(m.Find("c")->blocks[0], shared);
  // Truncating into an unshared cached block uncaches it.
  ASSERT_TRUE(m.Free("b").ok());
  ASSERT_TRUE(m.Free("c").ok());
  Step(m, "d", Range(40, 46));
  Events(m);
  ASSERT_TRUE(m.Truncate("d", 3, &copy).ok());
  EXPECT_FALSE(copy.has_value());
  std::vector<KvCacheEvent> events = Events(m);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<BlockRemovedEvent>(events[0]));
  EXPECT_EQ(Step(m, "e", Range(40, 46)), 0);
}

TEST(PrefixCacheTest, StartSequenceHoldsItsPrefix) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 13));
  absl::StatusOr<int32_t> cached = m.StartSequence("r", Range(0, 13));
  ASSERT_TRUE(cached.ok());
  EXPECT_EQ(*cached, 12);
  EXPECT_EQ(m.Find("r")->num_tokens, 12);
  EXPECT_EQ(m.StartSequence("r", {}).status().code(),
            absl::StatusCode::kAlreadyExists);
  // The first chunk continues it from the cached length.
  ASSERT_TRUE(m.Append({{"r", 1, SequenceCreation::kMustExist, {12}}}).ok());
  EXPECT_EQ(m.Find("r")->num_tokens, 13);
  ASSERT_TRUE(m.Free("a").ok());
  ASSERT_TRUE(m.Free("r").ok());
  EXPECT_EQ(m.Stats().used_blocks, 0);
}

TEST(PrefixCacheTest, AttachWithTokenIdsCachesImportedBlocks) {
  KvCacheManager m = Caching(16);
  absl::StatusOr<SequenceKv> kv = m.AllocateDetached(9);
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ(m.Attach("x", *kv, Range(0, 3)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.Attach("x", *kv, Range(0, 9)).ok());
  EXPECT_EQ(m.Stats().cached_blocks, 2);
  EXPECT_EQ(Step(m, "y", Range(0, 10)), 8);
}

TEST(PrefixCacheTest, AnImportAllocatesOnlyWhatIsNotCached) {
  KvCacheManager m = Caching(16);
  Step(m, "a", Range(0, 13));  // 3 cached blocks
  int32_t cached = -1;
  absl::StatusOr<SequenceKv> kv = m.AllocateDetached(14, Range(0, 14), &cached);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(cached, 12);
  ASSERT_EQ(kv->blocks.size(), 4u);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(kv->blocks[b], m.Find("a")->blocks[b]);
  EXPECT_EQ(m.Stats().detached_blocks, 4);
  // The pulled tail is cached once attached with its ids.
  ASSERT_TRUE(m.Attach("x", *kv).ok());
  EXPECT_EQ(Step(m, "y", Range(0, 17)), 12);
  EXPECT_EQ(m.AllocateDetached(5, Range(0, 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Without ids, or with caching off, nothing is shared.
  EXPECT_TRUE(m.AllocateDetached(14, {}, &cached).ok());
  EXPECT_EQ(cached, 0);
}

// Thousands of random operations against a shadow model of every slot's
// content (the token written there): a sequence must always read its own
// tokens back, so a shared block is never written; reference counts must
// never leak.
TEST(PrefixCacheTest, RandomizedAgainstShadowSlots) {
  constexpr int32_t kBlocks = 48;
  KvCacheManager m(kBlocks, kBs, /*max_model_len=*/64,
                   {PrefixCaching::kOn, "salt"});
  std::mt19937 rng(1234);
  // slot -> the token id last written there.
  std::vector<int32_t> slots(kBlocks * kBs, -2);
  std::map<std::string, std::vector<int32_t>> shadow;  // id -> tokens
  std::vector<SequenceKv> detached;
  std::vector<std::vector<int32_t>> detached_tokens;
  // A few prompt families so that prefixes repeat.
  std::vector<std::vector<int32_t>> families;
  for (int f = 0; f < 4; ++f) {
    std::vector<int32_t> p;
    for (int i = 0; i < 40; ++i) p.push_back(f * 1000 + i % (7 + f));
    families.push_back(p);
  }
  auto write = [&](const std::string& id, int32_t from) {
    const SequenceKv* kv = m.Find(id);
    const std::vector<int32_t>& tokens = shadow[id];
    for (int32_t p = from; p < kv->num_tokens; ++p) {
      // Nobody else may hold a block this sequence writes.
      ASSERT_EQ(m.ref_count(kv->blocks[p / kBs]), 1)
          << id << " writes position " << p << " into a shared block";
      slots[m.SlotFor(*kv, p)] = tokens[p];
    }
  };
  int next_id = 0;
  int64_t hits = 0, copies = 0;
  for (int op = 0; op < 6000; ++op) {
    const int kind = rng() % 10;
    if (kind <= 2 || shadow.empty()) {  // start a sequence
      const std::vector<int32_t>& fam = families[rng() % families.size()];
      const int32_t len = 1 + rng() % 30;
      std::vector<int32_t> tokens(fam.begin(), fam.begin() + len);
      if (rng() % 4 == 0) tokens.back() = 5000 + rng() % 50;
      const std::string id = "s" + std::to_string(next_id++);
      absl::StatusOr<StepReservation> r =
          m.Append({{id, len, SequenceCreation::kMustBeNew, tokens}});
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      const int32_t cached = r->entries[0].cached_tokens;
      hits += cached;
      shadow[id] = tokens;
      // The cached prefix is already there; the step writes the rest.
      for (int32_t p = 0; p < cached; ++p) {
        ASSERT_EQ(slots[m.SlotFor(*m.Find(id), p)], tokens[p]) << id;
      }
      write(id, cached);
      if (rng() % 5 == 0) {  // the step failed
        m.Undo(*r);
        shadow.erase(id);
      }
    } else if (kind <= 5) {  // step an existing sequence
      auto it = shadow.begin();
      std::advance(it, rng() % shadow.size());
      const int32_t n = 1 + rng() % 6;
      if (static_cast<int32_t>(it->second.size()) + n > 64) continue;
      std::vector<int32_t> more;
      for (int i = 0; i < n; ++i) more.push_back(rng() % 20);
      const int32_t before = static_cast<int32_t>(it->second.size());
      absl::StatusOr<StepReservation> r =
          m.Append({{it->first, n, SequenceCreation::kMustExist, more}});
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      it->second.insert(it->second.end(), more.begin(), more.end());
      write(it->first, before);
      if (rng() % 6 == 0) {
        m.Undo(*r);
        it->second.resize(before);
      }
    } else if (kind == 6) {  // release
      auto it = shadow.begin();
      std::advance(it, rng() % shadow.size());
      ASSERT_TRUE(m.Free(it->first).ok());
      shadow.erase(it);
    } else if (kind == 7) {  // truncate (a failed chunked call's rollback)
      auto it = shadow.begin();
      std::advance(it, rng() % shadow.size());
      const int32_t to = rng() % (it->second.size() + 1);
      std::optional<BlockCopy> copy;
      const absl::Status s = m.Truncate(it->first, to, &copy);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      if (copy.has_value()) {
        ++copies;
        for (int32_t t = 0; t < copy->num_tokens; ++t) {
          slots[copy->dst_block * kBs + t] = slots[copy->src_block * kBs + t];
        }
      }
      it->second.resize(to);
    } else if (kind == 8) {  // a lease: detach, later attach back or free
      if (!detached.empty() && rng() % 2 == 0) {
        const std::string id = "s" + std::to_string(next_id++);
        ASSERT_TRUE(m.Attach(id, detached.back(), detached_tokens.back()).ok());
        shadow[id] = detached_tokens.back();
        detached.pop_back();
        detached_tokens.pop_back();
      } else if (!detached.empty()) {
        m.FreeDetached(detached.back());
        detached.pop_back();
        detached_tokens.pop_back();
      } else {
        auto it = shadow.begin();
        std::advance(it, rng() % shadow.size());
        absl::StatusOr<SequenceKv> kv = m.Detach(it->first);
        ASSERT_TRUE(kv.ok());
        detached.push_back(std::move(*kv));
        detached_tokens.push_back(it->second);
        shadow.erase(it);
      }
    } else if (rng() % 50 == 0) {
      m.ClearPrefixCache();
    }
    // Every live sequence reads its own tokens back.
    int64_t held = 0;
    for (const auto& [id, tokens] : shadow) {
      const SequenceKv* kv = m.Find(id);
      ASSERT_NE(kv, nullptr) << id;
      ASSERT_EQ(kv->num_tokens, static_cast<int32_t>(tokens.size())) << id;
      ASSERT_EQ(kv->token_ids, tokens) << id;
      for (int32_t p = 0; p < kv->num_tokens; ++p) {
        ASSERT_EQ(slots[m.SlotFor(*kv, p)], tokens[p])
            << "op " << op << " seq " << id << " position " << p;
      }
      held += static_cast<int64_t>(kv->blocks.size());
    }
    for (const SequenceKv& kv : detached) {
      held += static_cast<int64_t>(kv.blocks.size());
    }
    // Distinct blocks held <= references held; free + used == total.
    const KvCacheStats s = m.Stats();
    ASSERT_EQ(s.free_blocks + s.used_blocks, kBlocks);
    ASSERT_LE(s.used_blocks, held);
  }
  EXPECT_GT(hits, 0);
  EXPECT_GT(copies, 0);
  EXPECT_GT(m.Stats().evictions, 0);
  for (const auto& [id, tokens] : shadow) ASSERT_TRUE(m.Free(id).ok());
  for (SequenceKv& kv : detached) m.FreeDetached(kv);
  const KvCacheStats s = m.Stats();
  EXPECT_EQ(s.used_blocks, 0);
  EXPECT_EQ(s.free_blocks, kBlocks);
  EXPECT_EQ(s.detached_blocks, 0);
  EXPECT_EQ(s.num_sequences, 0);
}

}  // namespace
}  // namespace pdworker
