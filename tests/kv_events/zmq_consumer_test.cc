// pdworker's ZMQ KV events read by a consumer that is not ours
// (zmq_consumer.py: Debian's pyzmq and msgpack, llm-d's way of reading
// vLLM): every field of every batch checked against the plan written here
// before publishing, with the publisher binding (the consumer connects) and
// connecting (the consumer binds), in both event layouts. The first batches
// go out before the consumer subscribes, so they reach it only through the
// replay socket.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/kv_events/kv_event_test_util.h"
#include "tests/server/subprocess.h"
#include "worker/kv_events/kv_event_publisher.h"

namespace pdworker {
namespace {

using kv_events_testing::Batch;
using kv_events_testing::EventJson;
using kv_events_testing::RandomBatches;
using server_testing::RunfilePath;
using server_testing::Subprocess;

constexpr int kBatches = 48;
constexpr int kBeforeSubscribing = 10;

struct Mode {
  bool publisher_binds;
  KvEventLayout layout;
};

std::string ModeName(const testing::TestParamInfo<Mode>& info) {
  return absl::StrCat(info.param.publisher_binds ? "Bind" : "Connect",
                      info.param.layout == KvEventLayout::kTaggedMap
                          ? "TaggedMap"
                          : "Positional");
}

double Ts(int i) { return 1767225600.0 + 0.001 * i + 1e-7; }

class ZmqConsumerTest : public testing::TestWithParam<Mode> {
 protected:
  std::string TmpPath(const std::string& name) {
    return absl::StrCat(testing::TempDir(), "/",
                        ModeName(testing::TestParamInfo<Mode>(GetParam(), 0)),
                        "_", name);
  }

  // Written whole, then renamed: the consumer polls for it.
  void WritePlan(const KvEventPublisherOptions& options,
                 const std::string& sub_endpoint,
                 const std::string& replay_endpoint) {
    nlohmann::json plan;
    plan["topic"] = options.topic;
    plan["sub_endpoint"] = sub_endpoint;
    plan["replay_endpoint"] = replay_endpoint;
    plan["layout"] = std::string{KvEventLayoutName(options.format.layout)};
    plan["medium"] = options.format.medium;
    plan["dp_rank"] = options.format.data_parallel_rank;
    for (int i = 0; i < kBatches; ++i) {
      nlohmann::json batch;
      batch["ts"] = Ts(i);
      batch["events"] = nlohmann::json::array();
      for (const KvCacheEvent& e : batches_[i]) {
        batch["events"].push_back(EventJson(e));
      }
      plan["batches"].push_back(batch);
    }
    const std::string tmp = plan_path_ + ".tmp";
    std::ofstream(tmp) << plan.dump();
    ASSERT_EQ(std::rename(tmp.c_str(), plan_path_.c_str()), 0);
  }

  std::vector<Batch> batches_ = RandomBatches(kBatches, /*seed=*/2026);
  std::string plan_path_ = TmpPath("plan.json");
};

TEST_P(ZmqConsumerTest, EveryBatchArrivesAndDecodes) {
  const Mode mode = GetParam();
  KvEventPublisherOptions options;
  options.topic = "kv@10.1.2.3@tiny-llama";
  options.replay_endpoint = "tcp://127.0.0.1:*";
  options.format.layout = mode.layout;

  std::vector<std::string> argv = {
      "/usr/bin/python3", RunfilePath("tests/kv_events/zmq_consumer.py"),
      "--plan=" + plan_path_};
  std::unique_ptr<KvEventPublisher> publisher;
  std::unique_ptr<Subprocess> consumer;
  auto start_consumer = [&] {
    auto started = Subprocess::Start(argv, TmpPath("consumer.log"));
    ASSERT_TRUE(started.ok()) << started.status();
    consumer = std::move(*started);
  };
  auto create_publisher = [&] {
    auto created = KvEventPublisher::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    publisher = std::move(*created);
    EXPECT_EQ(publisher->binds(), mode.publisher_binds);
  };

  if (mode.publisher_binds) {
    options.endpoint = "tcp://127.0.0.1:*";
    ASSERT_NO_FATAL_FAILURE(create_publisher());
    ASSERT_NO_FATAL_FAILURE(WritePlan(options, publisher->endpoint(),
                                      publisher->replay_endpoint()));
    for (int i = 0; i < kBeforeSubscribing; ++i) {
      publisher->Publish(batches_[i], Ts(i));
    }
    ASSERT_NO_FATAL_FAILURE(start_consumer());
  } else {
    argv.push_back("--bind_sub");
    ASSERT_NO_FATAL_FAILURE(start_consumer());
    auto out = consumer->WaitForOutput("sub_endpoint ", absl::Seconds(30));
    ASSERT_TRUE(out.ok()) << out.status();
    // The line after the marker: "sub_endpoint tcp://127.0.0.1:PORT".
    absl::string_view rest =
        absl::string_view(*out).substr(out->find("sub_endpoint ") + 13);
    options.endpoint = std::string{rest.substr(0, rest.find('\n'))};
    ASSERT_FALSE(options.endpoint.empty());
    ASSERT_NO_FATAL_FAILURE(create_publisher());
    ASSERT_NO_FATAL_FAILURE(
        WritePlan(options, "", publisher->replay_endpoint()));
    for (int i = 0; i < kBeforeSubscribing; ++i) {
      publisher->Publish(batches_[i], Ts(i));
    }
  }
  ASSERT_TRUE(consumer->WaitForOutput("ready", absl::Seconds(30)).ok())
      << consumer->Output();
  for (int i = kBeforeSubscribing; i < kBatches; ++i) {
    publisher->Publish(batches_[i], Ts(i));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto code = consumer->Wait(absl::Seconds(90));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << consumer->Output();
  ASSERT_EQ(*code, 0) << consumer->Output();

  nlohmann::json summary;
  for (absl::string_view line : absl::StrSplit(consumer->Output(), '\n')) {
    if (absl::StartsWith(line, "{")) summary = nlohmann::json::parse(line);
  }
  ASSERT_TRUE(summary.is_object()) << consumer->Output();
  std::cout << "consumer: " << summary.dump() << "\n";
  EXPECT_EQ(summary["live"].get<int>() + summary["replayed"].get<int>(),
            kBatches);
  EXPECT_GE(summary["live"].get<int>(), 1) << consumer->Output();
  if (mode.publisher_binds) {
    // Published before the consumer existed: only the replay had them.
    EXPECT_GE(summary["replayed"].get<int>(), kBeforeSubscribing);
  }
  EXPECT_EQ(publisher->stats().dropped_hwm, 0);
  EXPECT_GE(publisher->stats().replay_requests, 1);
}

INSTANTIATE_TEST_SUITE_P(BindAndConnect, ZmqConsumerTest,
                         testing::Values(Mode{true, KvEventLayout::kTaggedMap},
                                         Mode{true, KvEventLayout::kPositional},
                                         Mode{false, KvEventLayout::kTaggedMap},
                                         Mode{false,
                                              KvEventLayout::kPositional}),
                         ModeName);

}  // namespace
}  // namespace pdworker
