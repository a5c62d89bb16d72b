#include "worker/kv_events/kv_events_config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

TEST(KvEventsConfigTest, VllmKeysAndDefaults) {
  VllmEventBatchFormat format;
  format.layout = KvEventLayout::kPositional;
  auto options = ParseKvEventsConfig(
      R"({"enable_kv_cache_events": true, "publisher": "zmq",
          "endpoint": "tcp://indexer:5557", "replay_endpoint": "tcp://*:5558",
          "topic": "kv@10.0.0.7@llama", "buffer_steps": 50, "hwm": 7,
          "max_queue_size": 9})",
      format);
  ASSERT_TRUE(options.ok()) << options.status();
  ASSERT_TRUE(options->has_value());
  EXPECT_EQ((*options)->endpoint, "tcp://indexer:5557");
  EXPECT_EQ((*options)->replay_endpoint, "tcp://*:5558");
  EXPECT_EQ((*options)->topic, "kv@10.0.0.7@llama");
  EXPECT_EQ((*options)->buffer_steps, 50);
  EXPECT_EQ((*options)->hwm, 7);
  EXPECT_EQ((*options)->max_queue_size, 9);
  EXPECT_EQ((*options)->format.layout, KvEventLayout::kPositional);

  auto defaults = ParseKvEventsConfig(R"({"enable_kv_cache_events": true})");
  ASSERT_TRUE(defaults.ok());
  ASSERT_TRUE(defaults->has_value());
  EXPECT_EQ((*defaults)->endpoint, "tcp://*:5557");
  EXPECT_EQ((*defaults)->replay_endpoint, "");
  EXPECT_EQ((*defaults)->buffer_steps, 10000);
  EXPECT_EQ((*defaults)->hwm, 100000);
}

TEST(KvEventsConfigTest, OffWhenDisabledOrNull) {
  EXPECT_FALSE(ParseKvEventsConfig("{}")->has_value());
  EXPECT_FALSE(
      ParseKvEventsConfig(R"({"enable_kv_cache_events": false})")->has_value());
  EXPECT_FALSE(ParseKvEventsConfig(
                   R"({"enable_kv_cache_events": true, "publisher": "null"})")
                   ->has_value());
}

TEST(KvEventsConfigTest, RefusalsNameTheKey) {
  auto unknown = ParseKvEventsConfig(
      R"({"enable_kv_cache_events": true, "endpoints": "tcp://*:1"})");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), testing::HasSubstr("\"endpoints\""));
  EXPECT_THAT(ParseKvEventsConfig(R"({"hwm": -1})").status().message(),
              testing::HasSubstr("\"hwm\""));
  EXPECT_THAT(
      ParseKvEventsConfig(R"({"publisher": "kafka"})").status().message(),
      testing::HasSubstr("\"publisher\""));
  EXPECT_THAT(ParseKvEventsConfig("[1]").status().message(),
              testing::HasSubstr("--kv-events-config"));
  EXPECT_THAT(ParseKvEventsConfig("{").status().message(),
              testing::HasSubstr("not valid JSON"));
  // A number a double cannot hold: refused, not an uncaught exception.
  EXPECT_THAT(ParseKvEventsConfig(R"({"hwm": 1e999})").status().message(),
              testing::HasSubstr("number overflow"));
}

}  // namespace
}  // namespace pdworker
