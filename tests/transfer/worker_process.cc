#include "tests/transfer/worker_process.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pdworker::handoff_testing {

v1::WorkerStatus WorkerProcess::Status() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::WorkerStatus status;
  const grpc::Status s =
      stub->GetStatus(&context, v1::GetStatusRequest(), &status);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return status;
}

std::unique_ptr<WorkerProcess> StartWorkerProcess(
    const std::string& binary, const std::vector<std::string>& flags,
    const std::string& log_path, absl::Duration startup) {
  std::vector<std::string> args = {binary, "--host=127.0.0.1", "--port=0",
                                   "--metrics_port=-1"};
  args.insert(args.end(), flags.begin(), flags.end());
  auto w = std::make_unique<WorkerProcess>();
  auto process = server_testing::Subprocess::Start(args, log_path);
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return nullptr;
  w->process = *std::move(process);
  auto output = w->process->WaitForOutput("listening on ", startup);
  EXPECT_TRUE(output.ok()) << output.status();
  if (!output.ok()) return nullptr;
  const size_t at = output->find("listening on ") + 13;
  EXPECT_TRUE(absl::SimpleAtoi(output->substr(at, output->find('\n', at) - at),
                               &w->port));
  w->stub = v1::Worker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", w->port), grpc::InsecureChannelCredentials()));
  return w;
}

std::string TmpPath(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

}  // namespace pdworker::handoff_testing
