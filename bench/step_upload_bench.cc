// A step's input upload: one pageable cudaMemcpyAsync per metadata array
// (what StepInputs::Upload did until 2026-11-27, emulated here with the same
// eight copies and sizes) against StepInputs' packed upload (one DMA from a
// pinned block, then the unpack kernel). Decode batches at a 512-token
// context (32 blocks of 16) in block tables max_blocks_per_seq wide: the
// per-array upload copies every row in full, the packed one only the blocks
// each sequence holds.
// Per shape, median of --reps: "enqueue" is the host time to issue the
// upload (what the overlapped engine loop pays on the host), "total" adds
// the Synchronize (what a synchronous step waits before the forward starts).
//
//   bazel build --config=opt //bench:step_upload_bench
//   bazel-bin/bench/step_upload_bench [--device=cuda|cpu] [--jsonl=FILE
//       --commit=SHA]
// Without a usable GPU (and --device=cuda) it prints why and exits 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "bench/gpu_bench_util.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/step_inputs.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"

ABSL_FLAG(std::string, device, "cuda", "cuda or cpu (a smoke run).");
ABSL_FLAG(std::vector<std::string>, batches,
          (std::vector<std::string>{"1", "8", "64", "256"}),
          "Decode batch sizes.");
ABSL_FLAG(std::vector<std::string>, max_blocks,
          (std::vector<std::string>{"256", "8192"}),
          "Block-table widths (a 4k and a 128k max_model_len at 16-token "
          "blocks).");
ABSL_FLAG(int, reps, 200, "Timed uploads per measurement (median).");
ABSL_FLAG(std::string, jsonl, "", "Append gpu.jsonl records to this file.");
ABSL_FLAG(std::string, commit, "", "Commit the binary was built from.");

namespace pdworker {
namespace {

constexpr int kBlockSize = 16, kContext = 512, kMaxSeqs = 256;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timing {
  double enqueue_us = 0, total_us = 0;
};

// Median enqueue and enqueue + Synchronize times of `upload`.
template <typename Upload>
Timing Time(Stream& stream, int reps, const Upload& upload) {
  std::vector<double> enqueue, total;
  for (int rep = 0; rep < reps + 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(upload().ok());
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(stream.Synchronize().ok());
    const auto t2 = std::chrono::steady_clock::now();
    if (rep < 5) continue;
    enqueue.push_back(
        std::chrono::duration<double, std::micro>(t1 - t0).count());
    total.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  return {Median(enqueue), Median(total)};
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  const bool on_cpu = absl::GetFlag(FLAGS_device) == "cpu";
  CHECK(on_cpu || absl::GetFlag(FLAGS_device) == "cuda")
      << "--device must be cuda or cpu";
  auto device = CreateDevice(on_cpu ? DeviceKind::kCpu : DeviceKind::kCuda);
  if (!device.ok()) {
    std::printf("step_upload_bench: skipped (%s)\n",
                std::string(device.status().message()).c_str());
    return 0;
  }
  auto stream = (*device)->CreateStream();
  CHECK(stream.ok()) << stream.status();
  const int reps = absl::GetFlag(FLAGS_reps);
  const std::string name = (*device)->name();
  std::printf(
      "device: %s; decode batches, context %d, median of %d; us\n\n"
      "| batch | max_blocks_per_seq | per-array enqueue | total | packed "
      "enqueue | total | total speed-up |\n| ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: |\n",
      name.c_str(), kContext, reps);
  std::vector<nlohmann::json> records;
  for (const std::string& mb_text : absl::GetFlag(FLAGS_max_blocks)) {
    int max_blocks = 0;
    CHECK(absl::SimpleAtoi(mb_text, &max_blocks) &&
          max_blocks >= kContext / kBlockSize)
        << mb_text;
    const StepLimits limits{kMaxSeqs, kMaxSeqs, max_blocks, 4, kMaxSeqs};
    auto arena = Arena::Create(
        **device,
        {static_cast<size_t>(StepInputs::DeviceWords(limits)) * 4 + 16 * 256,
         256, "step_upload_bench"});
    CHECK(arena.ok()) << arena.status();
    auto inputs = StepInputs::Create(**device, **arena, limits, kBlockSize);
    CHECK(inputs.ok()) << inputs.status();
    const StepBuffers& b = (*inputs)->buffers();
    // The per-array upload's host arrays, at their static sizes.
    std::vector<int32_t> tokens(kMaxSeqs), seqs(kMaxSeqs + 1),
        tables(static_cast<size_t>(kMaxSeqs) * max_blocks);
    for (const std::string& batch_text : absl::GetFlag(FLAGS_batches)) {
      int batch = 0;
      CHECK(absl::SimpleAtoi(batch_text, &batch) && batch >= 1 &&
            batch <= kMaxSeqs)
          << batch_text;
      std::vector<SequenceKv> kv(batch);
      std::vector<int32_t> token = {7};
      std::vector<StepSequence> step;
      for (int r = 0; r < batch; ++r) {
        kv[r].num_tokens = kContext;
        for (int j = 0; j < kContext / kBlockSize; ++j) {
          kv[r].blocks.push_back(r * (kContext / kBlockSize) + j);
        }
      }
      for (int r = 0; r < batch; ++r) step.push_back({&kv[r], token});
      CHECK((*inputs)->Build(step, {batch, batch, 1}).ok());
      const size_t tok = batch * sizeof(int32_t), req = tok;
      const int32_t num_reqs = batch;
      const Timing per_array = Time(**stream, reps, [&]() -> absl::Status {
        Stream& s = **stream;
        struct Copy {
          DeviceBuffer dst;
          const void* src;
          size_t bytes;
        };
        for (const Copy& c : {
                 Copy{b.token_ids, tokens.data(), tok},
                 Copy{b.positions, tokens.data(), tok},
                 Copy{b.slot_mapping, tokens.data(), tok},
                 Copy{b.seq_lens, seqs.data(), req},
                 Copy{b.query_start_loc, seqs.data(), req + sizeof(int32_t)},
                 Copy{b.num_reqs, &num_reqs, sizeof(int32_t)},
                 Copy{b.block_tables, tables.data(), req * max_blocks},
                 Copy{b.logits_indices, seqs.data(),
                      kMaxSeqs * sizeof(int32_t)},
             }) {
          absl::Status status = s.CopyToDevice(c.dst, c.src, c.bytes);
          if (!status.ok()) return status;
        }
        return absl::OkStatus();
      });
      const Timing packed =
          Time(**stream, reps, [&] { return (*inputs)->Upload(**stream); });
      std::printf("| %d | %d | %.1f | %.1f | %.1f | %.1f | %.2fx |\n", batch,
                  max_blocks, per_array.enqueue_us, per_array.total_us,
                  packed.enqueue_us, packed.total_us,
                  per_array.total_us / packed.total_us);
      for (const auto& [system, t] :
           {std::pair<const char*, Timing>{"pdworker_per_array_upload",
                                           per_array},
            {"pdworker_packed_upload", packed}}) {
        records.push_back({{"metric", "step_upload_us"},
                           {"shape", "max_blocks_" + mb_text},
                           {"system", system},
                           {"batch", batch},
                           {"tokens", batch},
                           {"context", kContext},
                           {"value", t.total_us},
                           {"enqueue_us", t.enqueue_us}});
      }
    }
  }
  const std::string path = absl::GetFlag(FLAGS_jsonl);
  if (!path.empty() && !on_cpu) {
    AppendGpuRecords(path, name, absl::GetFlag(FLAGS_commit),
                     std::move(records));
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
