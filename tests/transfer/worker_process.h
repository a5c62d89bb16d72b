// A real pdworker process for handoff tests (kv_fault_test on the CPU,
// cuda_worker_gpu_test on a GPU): started on a kernel-chosen loopback port,
// output in a log file, a Worker stub to it.
#ifndef PDWORKER_TESTS_TRANSFER_WORKER_PROCESS_H_
#define PDWORKER_TESTS_TRANSFER_WORKER_PROCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "tests/server/subprocess.h"

namespace pdworker::handoff_testing {

struct WorkerProcess {
  std::unique_ptr<server_testing::Subprocess> process;
  int port = 0;
  std::unique_ptr<v1::Worker::Stub> stub;

  // GetStatus with a 10 s deadline (EXPECTs it to succeed).
  v1::WorkerStatus Status();
};

// Runs `binary` with `flags` plus --host=127.0.0.1 --port=0
// --metrics_port=-1, output to `log_path`, and waits up to `startup` for
// "listening on PORT". nullptr (after a test failure) when it does not
// start.
std::unique_ptr<WorkerProcess> StartWorkerProcess(
    const std::string& binary, const std::vector<std::string>& flags,
    const std::string& log_path, absl::Duration startup = absl::Seconds(120));

// $TEST_TMPDIR/name, or /tmp/name outside bazel.
std::string TmpPath(const std::string& name);

}  // namespace pdworker::handoff_testing

#endif  // PDWORKER_TESTS_TRANSFER_WORKER_PROCESS_H_
