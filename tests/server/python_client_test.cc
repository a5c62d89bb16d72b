// A Python grpcio client (tests/server/python_client.py, with stubs from
// protoc's grpc_python_plugin) against the pdworker binary: Forward,
// GetStatus, GetGraphStats and the standard health check.
#include <signal.h>

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"

namespace pdworker {
namespace {

using server_testing::RunfilePath;
using server_testing::Subprocess;

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

TEST(PythonClientTest, GrpcioClientTalksToPdworker) {
  auto worker = Subprocess::Start(
      {RunfilePath("worker/pdworker"),
       "--model=" + server_testing::TinyModelDir(), "--host=127.0.0.1",
       "--port=0", "--metrics_port=-1", "--max_num_seqs=4",
       "--max_num_batched_tokens=32", "--max_model_len=64",
       "--kv_cache_bytes=65536", "--block_size=4",
       "--compilation_config={\"cudagraph_capture_sizes\":[1,2,4]}"},
      TmpPath("worker.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto output = (*worker)->WaitForOutput("listening on ", absl::Seconds(120));
  ASSERT_TRUE(output.ok()) << output.status();
  const size_t at = output->find("listening on ") + 13;
  int port = 0;
  ASSERT_TRUE(
      absl::SimpleAtoi(output->substr(at, output->find('\n', at) - at), &port));

  // Debian's grpcio lives in /usr/bin/python3's dist-packages; the
  // generated modules are imported by their bare names.
  auto client = Subprocess::Start(
      {"/usr/bin/python3", RunfilePath("tests/server/python_client.py"),
       absl::StrCat("--target=127.0.0.1:", port)},
      TmpPath("python.log"),
      {absl::StrCat("PYTHONPATH=", RunfilePath("proto"), ":",
                    RunfilePath("third_party/grpc_health"))});
  ASSERT_TRUE(client.ok()) << client.status();
  auto code = (*client)->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << (*client)->Output();

  (*worker)->Signal(SIGTERM);
  auto worker_code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(worker_code.ok());
  EXPECT_EQ(*worker_code, 0) << (*worker)->Output();
}

}  // namespace
}  // namespace pdworker
