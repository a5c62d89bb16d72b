// A request body that is not its method's message gets INVALID_ARGUMENT
// saying it could not be parsed, from every RPC of pdworker's own services
// (pdworker.v1.Worker, pdworker.v1.KvTransfer, vllm.grpc.engine.VllmEngine),
// and changes nothing. gRPC's callback server would answer UNIMPLEMENTED
// with an empty message before our handlers run (worker/server/
// parsed_call.h). The bytes come from Python grpcio's generic calls, a
// client that is not ours.
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/vllm_engine.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;
using server_testing::Input;
using server_testing::Request;
using server_testing::RunfilePath;
using server_testing::Subprocess;
using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

TEST(UnparsableRequestTest, EveryRpcAnswersInvalidArgumentAndChangesNothing) {
  std::unique_ptr<server_testing::TestWorker> worker =
      server_testing::StartWorker(server_testing::SmallRunnerOptions());
  ASSERT_NE(worker, nullptr);
  // A live sequence, so "changes nothing" covers one that exists.
  v1::ForwardResponse started;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(worker->stub
                    ->Forward(&context,
                              Request({Input("live", {1, 2, 3}, true)}),
                              &started)
                    .ok());
  }
  const v1::WorkerStatus before = worker->Status();

  const std::string out = TmpPath("unparsable.json");
  auto client = Subprocess::Start(
      {"/usr/bin/python3",
       RunfilePath("tests/server/unparsable_request_client.py"),
       absl::StrCat("--target=127.0.0.1:", worker->server->port()),
       "--out=" + out},
      TmpPath("unparsable_client.log"),
      {absl::StrCat("PYTHONPATH=", RunfilePath(""))});
  ASSERT_TRUE(client.ok()) << client.status();
  auto code = (*client)->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << (*client)->Output();
  std::ifstream in(out);
  ASSERT_TRUE(in.good());
  const Json records = Json::parse(in);

  // Every method of the three services was tried (the list comes from the
  // C++ descriptors, independent of the client's).
  std::set<std::string> expected_methods;
  for (const char* name :
       {v1::Worker::service_full_name(), v1::KvTransfer::service_full_name(),
        vllm::grpc::engine::VllmEngine::service_full_name()}) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
            name);
    ASSERT_NE(service, nullptr) << name;
    for (int i = 0; i < service->method_count(); ++i) {
      expected_methods.insert(service->method(i)->full_name());
    }
  }
  std::set<std::string> tried;
  int utf8_cases = 0;
  for (const Json& r : records) {
    const std::string method = absl::StrCat(
        r["service"].get<std::string>(), ".", r["method"].get<std::string>());
    tried.insert(method);
    SCOPED_TRACE(absl::StrCat(method, ", ", r["case"].get<std::string>()));
    EXPECT_EQ(r["code"], "INVALID_ARGUMENT") << r["details"];
    EXPECT_THAT(r["details"].get<std::string>(),
                HasSubstr(absl::StrCat("could not be parsed as ",
                                       r["request_type"].get<std::string>())));
    if (r["case"].get<std::string>().rfind("invalid UTF-8", 0) == 0) {
      ++utf8_cases;
    }
  }
  EXPECT_EQ(tried, expected_methods);
  EXPECT_GE(utf8_cases, 8);  // Forward, ImportKv, Generate, Abort, PullKv...

  // Nothing changed: the same KV, sequences, leases and imports; the live
  // sequence still steps.
  const v1::WorkerStatus after = worker->Status();
  EXPECT_EQ(after.kv_blocks_free(), before.kv_blocks_free());
  EXPECT_EQ(after.num_sequences(), before.num_sequences());
  EXPECT_EQ(after.kv_leases(), 0);
  EXPECT_EQ(after.kv_imports(), 0);
  grpc::ClientContext context;
  v1::SequenceInput next =
      Input("live", {started.sequences(0).token_id()}, false);
  next.set_release_after_step(true);
  v1::ForwardResponse stepped;
  ASSERT_TRUE(worker->stub->Forward(&context, Request({next}), &stepped).ok());
  EXPECT_EQ(stepped.sequences(0).num_tokens(), 4);
}

}  // namespace
}  // namespace pdworker
