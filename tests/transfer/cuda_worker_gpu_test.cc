// The CUDA worker end to end (tag gpu; skips without a GPU): three
// `pdworker --device=cuda` processes on one GPU — prefill,
// decode and aggregated (role both) — on a tiny bf16 checkpoint. Each prompt
// is handed off prefill -> decode over CUDA IPC and, forced, over the gRPC
// stream, then decoded greedily; the tokens must equal the aggregated
// worker's for the same prompt (same kernels, shapes and block size on both
// paths, so bf16 rounding cannot tell them apart). Every worker ends holding
// no KV block, sequence, lease or import.
//
// The same test runs with --device=cpu (gRPC stream only: CPU workers offer
// nothing else), so CI proves the test's own logic before a GPU runs it.
// On the GPU machine the test finds pdworker next to its own binary (the
// bundle from scripts/gpu-bundle) when there is no runfiles tree.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/server/subprocess.h"
#include "tests/transfer/handoff_test_util.h"
#include "tests/transfer/worker_process.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace {

using handoff_testing::HandleOf;
using handoff_testing::Hold;
using handoff_testing::HoldsNothing;
using handoff_testing::Import;
using handoff_testing::StartWorkerProcess;
using handoff_testing::TmpPath;
using handoff_testing::WorkerProcess;
using server_testing::Input;
using server_testing::Request;

constexpr int kDecodeSteps = 8;

std::string PdworkerBinary() {
  const std::string runfile = server_testing::RunfilePath("worker/pdworker");
  if (std::filesystem::exists(runfile)) return runfile;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() /
          "pdworker")
      .string();
}

struct Backend {
  std::string name;                     // test suffix
  std::vector<std::string> flags;       // --device and friends
  std::vector<std::string> transports;  // handed off over each in turn
};

std::unique_ptr<WorkerProcess> StartWorker(const Backend& backend,
                                           const std::string& model_dir,
                                           const std::string& role) {
  std::vector<std::string> flags = {
      "--model=" + model_dir, "--role=" + role,
      "--max_num_seqs=4",     "--max_num_batched_tokens=64",
      "--max_model_len=128",  "--kv_cache_bytes=4194304",
      "--block_size=16",      "--stats_log_interval=0"};
  flags.insert(flags.end(), backend.flags.begin(), backend.flags.end());
  return StartWorkerProcess(
      PdworkerBinary(), flags,
      TmpPath(absl::StrCat(backend.name, "_", role, ".log")),
      absl::Seconds(300));
}

// `steps` greedy decode steps of sequence `id` on `worker`, from `token`.
std::vector<int32_t> Decode(v1::Worker::Stub& worker, const std::string& id,
                            int32_t token, int steps) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < steps; ++i) {
    v1::SequenceInput input = Input(id, {token}, false);
    input.set_release_after_step(i + 1 == steps);
    v1::ForwardResponse response;
    const grpc::Status s =
        server_testing::Forward(worker, Request({input}), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (!s.ok()) break;
    token = response.sequences(0).token_id();
    tokens.push_back(token);
  }
  return tokens;
}

// Polls until `worker` holds nothing (ReleaseKv reaches the source just
// after ImportKv answers).
bool BecomesEmpty(WorkerProcess& worker) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < give_up) {
    if (HoldsNothing(worker.Status())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

class WorkerProcessHandoffTest : public ::testing::TestWithParam<Backend> {};

TEST_P(WorkerProcessHandoffTest, HandoffEqualsAggregated) {
  const Backend& backend = GetParam();
  const bool cuda = backend.name == "cuda";
  if (cuda && !CreateDevice(DeviceKind::kCuda).ok()) {
    GTEST_SKIP() << "no usable CUDA device";
  }
  const std::string model_dir = TmpPath(backend.name + "_worker_model");
  TinyModelOptions model;
  model.shape = TinyShape::kGqa;
  model.dtype = DType::kBFloat16;
  ASSERT_TRUE(WriteTinyModel(model, model_dir).ok());

  auto prefill = StartWorker(backend, model_dir, "prefill");
  auto decode = StartWorker(backend, model_dir, "decode");
  auto both = StartWorker(backend, model_dir, "both");
  ASSERT_TRUE(prefill && decode && both);
  EXPECT_EQ(prefill->Status().device() != "cpu", cuda);

  const std::vector<std::vector<int32_t>> prompts = {
      {7},
      {1, 2, 3, 4, 5},
      {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17}};
  int n = 0;
  for (const std::string& transport : backend.transports) {
    for (const auto& prompt : prompts) {
      SCOPED_TRACE(absl::StrCat(transport, ", prompt of ", prompt.size()));
      const std::string id = absl::StrCat("s", n++);

      // Aggregated: prefill, then the decode steps, on one worker.
      v1::ForwardResponse first;
      ASSERT_TRUE(server_testing::Forward(
                      *both->stub, Request({Input(id, prompt, true)}), &first)
                      .ok());
      const int32_t token = first.sequences(0).token_id();
      const std::vector<int32_t> want =
          Decode(*both->stub, id, token, kDecodeSteps);

      // P/D: hold on prefill, import over `transport` only, decode there.
      const v1::ForwardResponse held = Hold(*prefill->stub, id, prompt);
      EXPECT_EQ(held.sequences(0).token_id(), token);
      v1::KvHandle handle = HandleOf(held);
      ASSERT_THAT(handle.transports(), ::testing::Contains(transport));
      handle.clear_transports();
      handle.add_transports(transport);
      v1::ImportKvResponse imported;
      const grpc::Status s = Import(*decode->stub, id, handle, &imported);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(imported.transport(), transport);
      EXPECT_EQ(imported.num_tokens(), static_cast<int>(prompt.size()));
      EXPECT_EQ(Decode(*decode->stub, id, token, kDecodeSteps), want);
    }
  }
  EXPECT_TRUE(BecomesEmpty(*prefill));
  EXPECT_TRUE(BecomesEmpty(*decode));
  EXPECT_TRUE(BecomesEmpty(*both));
}

INSTANTIATE_TEST_SUITE_P(
    Backends, WorkerProcessHandoffTest,
    ::testing::Values(Backend{"cpu", {"--device=cpu"}, {"grpc"}},
                      Backend{"cuda", {"--device=cuda"}, {"cuda_ipc", "grpc"}}),
    [](const ::testing::TestParamInfo<Backend>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace pdworker
