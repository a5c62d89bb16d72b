// The msgpack batch, decoded with msgpack-cxx's own reader: vLLM's outer
// array, and every event in both layouts with every field, type and order.
#include "worker/kv_events/vllm_event_batch.h"

#include <cstdint>
#include <msgpack.hpp>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

using Fields = std::vector<std::pair<std::string, msgpack::object>>;

std::string Str(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::STR);
  return o.type == msgpack::type::STR
             ? std::string(o.via.str.ptr, o.via.str.size)
             : "";
}

uint64_t Uint(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::POSITIVE_INTEGER);
  return o.via.u64;
}

std::vector<uint64_t> Uints(const msgpack::object& o) {
  std::vector<uint64_t> out;
  EXPECT_EQ(o.type, msgpack::type::ARRAY);
  if (o.type != msgpack::type::ARRAY) return out;
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    out.push_back(Uint(o.via.array.ptr[i]));
  }
  return out;
}

// The map's keys and values in wire order.
Fields MapFields(const msgpack::object& o) {
  Fields out;
  EXPECT_EQ(o.type, msgpack::type::MAP);
  if (o.type != msgpack::type::MAP) return out;
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    out.emplace_back(Str(o.via.map.ptr[i].key), o.via.map.ptr[i].val);
  }
  return out;
}

std::vector<std::string> Keys(const Fields& fields) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : fields) keys.push_back(k);
  return keys;
}

const msgpack::object& Element(const msgpack::object& array, uint32_t i) {
  EXPECT_EQ(array.type, msgpack::type::ARRAY);
  EXPECT_LT(i, array.via.array.size);
  return array.via.array.ptr[i];
}

constexpr uint64_t kHigh = 0xfedcba9876543210ull;  // above 2^63
constexpr uint64_t kLow = 5;
constexpr uint64_t kParent = 0x8000000000000001ull;
constexpr double kTs = 1767225600.123456789;

std::vector<KvCacheEvent> SampleEvents() {
  BlockStoredEvent stored;
  stored.block_hashes = {kHigh, kLow};
  stored.parent_block_hash = kParent;
  stored.token_ids = {1, 2, 3, 151999, 0, 65536, 7, 8};
  stored.block_size = 4;
  BlockRemovedEvent removed;
  removed.block_hashes = {kLow, ~uint64_t{0}};
  return {stored, removed, AllBlocksClearedEvent{}};
}

TEST(VllmEventBatchTest, TaggedMapsInsideVllmsPositionalBatch) {
  const std::string bytes =
      EncodeVllmEventBatch(SampleEvents(), kTs, VllmEventBatchFormat{});
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);
  // ts: a float64, exactly the stamp.
  ASSERT_EQ(Element(batch, 0).type, msgpack::type::FLOAT64);
  EXPECT_EQ(Element(batch, 0).via.f64, kTs);
  EXPECT_EQ(static_cast<uint8_t>(bytes[1]), 0xcb) << "ts is not a float64";
  EXPECT_EQ(Uint(Element(batch, 2)), 0u);  // data_parallel_rank
  const msgpack::object& events = Element(batch, 1);
  ASSERT_EQ(events.via.array.size, 3u);

  const Fields stored = MapFields(Element(events, 0));
  EXPECT_THAT(
      Keys(stored),
      testing::ElementsAre("type", "block_hashes", "parent_block_hash",
                           "token_ids", "block_size", "lora_id", "medium",
                           "lora_name", "group_idx", "kv_cache_spec_kind"));
  ASSERT_EQ(stored.size(), 10u);
  EXPECT_EQ(Str(stored[0].second), "BlockStored");
  EXPECT_THAT(Uints(stored[1].second), testing::ElementsAre(kHigh, kLow));
  EXPECT_EQ(Uint(stored[2].second), kParent);
  EXPECT_THAT(Uints(stored[3].second),
              testing::ElementsAre(1, 2, 3, 151999, 0, 65536, 7, 8));
  EXPECT_EQ(Uint(stored[4].second), 4u);
  EXPECT_EQ(stored[5].second.type, msgpack::type::NIL);
  EXPECT_EQ(Str(stored[6].second), "GPU");
  EXPECT_EQ(stored[7].second.type, msgpack::type::NIL);
  EXPECT_EQ(Uint(stored[8].second), 0u);
  EXPECT_EQ(Str(stored[9].second), "full_attention");

  const Fields removed = MapFields(Element(events, 1));
  EXPECT_THAT(Keys(removed), testing::ElementsAre("type", "block_hashes",
                                                  "medium", "group_idx"));
  ASSERT_EQ(removed.size(), 4u);
  EXPECT_EQ(Str(removed[0].second), "BlockRemoved");
  EXPECT_THAT(Uints(removed[1].second),
              testing::ElementsAre(kLow, ~uint64_t{0}));
  EXPECT_EQ(Str(removed[2].second), "GPU");
  EXPECT_EQ(Uint(removed[3].second), 0u);

  const Fields cleared = MapFields(Element(events, 2));
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_EQ(cleared[0].first, "type");
  EXPECT_EQ(Str(cleared[0].second), "AllBlocksCleared");
}

TEST(VllmEventBatchTest, PositionalArraysAsVllmBefore026) {
  VllmEventBatchFormat format;
  format.layout = KvEventLayout::kPositional;
  const std::string bytes = EncodeVllmEventBatch(SampleEvents(), kTs, format);
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.via.array.size, 3u);
  const msgpack::object& events = Element(batch, 1);
  ASSERT_EQ(events.via.array.size, 3u);

  const msgpack::object& stored = Element(events, 0);
  ASSERT_EQ(stored.type, msgpack::type::ARRAY);
  ASSERT_EQ(stored.via.array.size, 8u);
  EXPECT_EQ(Str(Element(stored, 0)), "BlockStored");
  EXPECT_THAT(Uints(Element(stored, 1)), testing::ElementsAre(kHigh, kLow));
  EXPECT_EQ(Uint(Element(stored, 2)), kParent);
  EXPECT_THAT(Uints(Element(stored, 3)),
              testing::ElementsAre(1, 2, 3, 151999, 0, 65536, 7, 8));
  EXPECT_EQ(Uint(Element(stored, 4)), 4u);
  EXPECT_EQ(Element(stored, 5).type, msgpack::type::NIL);  // lora_id
  EXPECT_EQ(Str(Element(stored, 6)), "GPU");               // medium
  EXPECT_EQ(Element(stored, 7).type, msgpack::type::NIL);  // lora_name

  const msgpack::object& removed = Element(events, 1);
  ASSERT_EQ(removed.via.array.size, 3u);
  EXPECT_EQ(Str(Element(removed, 0)), "BlockRemoved");
  EXPECT_THAT(Uints(Element(removed, 1)),
              testing::ElementsAre(kLow, ~uint64_t{0}));
  EXPECT_EQ(Str(Element(removed, 2)), "GPU");

  const msgpack::object& cleared = Element(events, 2);
  ASSERT_EQ(cleared.via.array.size, 1u);
  EXPECT_EQ(Str(Element(cleared, 0)), "AllBlocksCleared");
}

TEST(VllmEventBatchTest, NoParentMediumAndRankAsConfigured) {
  BlockStoredEvent stored;
  stored.block_hashes = {42};
  stored.token_ids = {9, 8};
  stored.block_size = 2;
  VllmEventBatchFormat format;
  format.medium = "CPU";
  format.data_parallel_rank = 3;
  const std::string bytes = EncodeVllmEventBatch({stored}, 2.5, format);
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  EXPECT_EQ(Uint(Element(batch, 2)), 3u);
  const Fields fields = MapFields(Element(Element(batch, 1), 0));
  ASSERT_EQ(fields.size(), 10u);
  EXPECT_EQ(fields[2].first, "parent_block_hash");
  EXPECT_EQ(fields[2].second.type, msgpack::type::NIL);
  EXPECT_EQ(Str(fields[6].second), "CPU");
}

TEST(VllmEventBatchTest, EmptyBatchAndAWholeSecondStayFloat64) {
  // msgpack-cxx's pack_double would write 1767225600.0 as an integer.
  const std::string bytes = EncodeVllmEventBatch({}, 1767225600.0, {});
  EXPECT_EQ(static_cast<uint8_t>(bytes[1]), 0xcb);
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.via.array.size, 3u);
  ASSERT_EQ(Element(batch, 0).type, msgpack::type::FLOAT64);
  EXPECT_EQ(Element(batch, 0).via.f64, 1767225600.0);
  EXPECT_EQ(Element(batch, 1).via.array.size, 0u);
}

TEST(VllmEventBatchDeathTest, TokensThatDoNotFillTheBlocks) {
  BlockStoredEvent stored;
  stored.block_hashes = {1, 2};
  stored.token_ids = {1, 2, 3};
  stored.block_size = 2;
  EXPECT_DEATH(EncodeVllmEventBatch({stored}, 1.0, {}), "carry 3 tokens");
}

TEST(VllmEventBatchTest, LayoutNames) {
  EXPECT_EQ(*ParseKvEventLayout("map"), KvEventLayout::kTaggedMap);
  EXPECT_EQ(*ParseKvEventLayout("array"), KvEventLayout::kPositional);
  EXPECT_EQ(ParseKvEventLayout("tuple").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvEventLayoutName(KvEventLayout::kPositional), "array");
}

}  // namespace
}  // namespace pdworker
