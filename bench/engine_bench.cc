// Engine-owned generation against the router driving Forward, in one run:
// for C concurrent generations of N tokens (C = 1 and 64 by default):
//
//  1. in-process step: ModelRunner::Execute of a C-sequence decode step, the
//     bound every other row is compared with;
//  2. engine-owned requests (Engine::Submit, in process), host/device
//     overlap on and off: tokens/s, inter-token latency p50/p99, and the
//     device's idle fraction between steps (stream time);
//  3. the reference router over loopback gRPC against an in-process worker
//     (aggregated role), driving step-level Forward (it schedules every
//     step) or sending the request-level Generate (what SMG sends; the
//     worker owns the decode loop): tokens/s, TTFT and ITL.
//
//   bazel build --config=opt //bench:engine_bench
//   bazel-bin/bench/engine_bench [--tokens=128] [--concurrency=1,64]
//       [--device=cpu|cuda] [--model_dir=DIR (default: the `small` tiny
//       model, written there)] [--json_out=FILE] [--temperature=T (the
//       engine-owned requests' sampling; 0 greedy)] [--kv_cache_mib=256
//       (1024 for the llama_1b shape at 64 x 160 tokens)]
//
// Prints Markdown for bench/RESULTS.md. On the CPU backend the stream runs
// on its own thread (as a GPU does), so overlap is real there too; absolute
// times are this machine's, the ratios are the point.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "tools/router/router.h"
#include "worker/engine/engine.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/device_factory.h"
#include "worker/server/worker_server.h"

ABSL_FLAG(int, tokens, 128, "Tokens generated per request.");
ABSL_FLAG(std::string, concurrency, "1,64", "Concurrent generations to run.");
ABSL_FLAG(int, prompt_len, 16, "Prompt tokens per request.");
ABSL_FLAG(float, temperature, 0.0f,
          "Sampling temperature of the engine-owned requests (0: greedy). "
          "Above 0 every step takes the general sampler, which is where a "
          "device-to-host read-back would cost the overlap.");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda.");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_small",
          "A checkpoint directory; the `small` tiny model is written there "
          "when it has no config.json.");
ABSL_FLAG(int, kv_cache_mib, 256,
          "KV cache size. 256 MiB holds 64 x 160 tokens of the small model; "
          "the llama_1b shape (32 KiB per token) needs 1024 for that.");
ABSL_FLAG(std::string, json_out, "", "Also write the figures as JSON here.");
ABSL_FLAG(bool, router_paths, true,
          "Also run the two router paths (Forward and Generate over gRPC), "
          "each with its own worker server; false keeps the in-process step "
          "and the engine (overlap on and off), about half the run.");
ABSL_FLAG(int, rounds, 3,
          "Runs of every path, interleaved; each figure is their median.");

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Percentiles {
  double p50 = 0, p99 = 0;
};
Percentiles Summarize(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  };
  return {at(0.50), at(0.99)};
}

std::vector<int32_t> Prompt(int seed, int length, int vocab) {
  std::vector<int32_t> p(length);
  for (int i = 0; i < length; ++i) p[i] = (seed * 31 + i * 7 + 3) % vocab;
  return p;
}

struct Setup {
  std::string model_dir;
  DeviceKind device = DeviceKind::kCpu;
  int tokens = 128;
  int prompt_len = 16;
  int max_num_seqs = 64;
  int64_t kv_cache_bytes = int64_t{256} << 20;
};

ModelRunnerOptions Options(const Setup& s) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;  // FULL_AND_PIECEWISE: decode steps replay FULL graphs
  o.max_num_seqs = s.max_num_seqs;
  o.max_num_batched_tokens = 2048;
  o.max_model_len = s.prompt_len + s.tokens + 16;
  o.kv_cache_bytes = s.kv_cache_bytes;
  o.block_size = 16;
  return o;
}

std::unique_ptr<Device> NewDevice(const Setup& s) {
  DeviceOptions options;
  options.cpu.stream_execution = CpuStreamExecution::kThreaded;
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice(s.device, options);
  CHECK(device.ok()) << device.status();
  return *std::move(device);
}

std::unique_ptr<ModelRunner> NewRunner(Device& device, const Setup& s) {
  auto runner = ModelRunner::Create(device, s.model_dir, Options(s));
  CHECK(runner.ok()) << runner.status();
  CHECK((*runner)->CaptureGraphs().ok());
  return *std::move(runner);
}

// 1. C sequences prefilled, then decode steps of all C timed one by one.
Percentiles InProcessStep(const Setup& s, int c) {
  auto device = NewDevice(s);
  auto runner = NewRunner(*device, s);
  const int vocab = static_cast<int>(runner->model_config().vocab_size);
  std::vector<SequenceStep> batch;
  for (int i = 0; i < c; ++i) {
    batch.push_back(MakeSequenceStep(absl::StrCat("s", i),
                                     Prompt(i, s.prompt_len, vocab),
                                     SequenceCreation::kMustBeNew));
  }
  auto result = runner->Execute(batch);
  CHECK(result.ok()) << result.status();
  std::vector<double> us;
  for (int step = 1; step < s.tokens; ++step) {
    for (int i = 0; i < c; ++i) {
      batch[i].token_ids = {result->sequences[i].token_id};
      batch[i].creation = SequenceCreation::kMustExist;
    }
    const auto t0 = Clock::now();
    result = runner->Execute(batch);
    us.push_back(Micros(Clock::now() - t0));
    CHECK(result.ok()) << result.status();
  }
  return Summarize(us);
}

struct GenerationFigures {
  double tokens_per_second = 0;
  Percentiles ttft_us;  // submit -> first token, per request
  Percentiles itl_us;
  double idle_fraction = -1;  // device idle between steps / stream time
};

// 2. C engine-owned requests at once.
GenerationFigures EngineRequests(const Setup& s, int c, StepOverlap overlap) {
  auto device = NewDevice(s);
  auto runner = NewRunner(*device, s);
  const int vocab = static_cast<int>(runner->model_config().vocab_size);
  EngineOptions options;
  options.overlap = overlap;
  Engine engine(*runner, options, /*metrics=*/nullptr);

  struct PerRequest {
    Clock::time_point submitted;
    std::vector<Clock::time_point> arrivals;
  };
  std::vector<PerRequest> per(c);
  std::mutex mu;
  std::atomic<int> done{0};
  const auto run = [&](const std::string& tag, bool timed) {
    done = 0;
    for (int i = 0; i < c; ++i) {
      auto request = std::make_unique<EngineRequest>();
      request->spec.request_id = absl::StrCat(tag, i);
      request->spec.prompt = Prompt(i, s.prompt_len, vocab);
      request->spec.stop.max_tokens = s.tokens;
      request->spec.stop.eos = EosHandling::kIgnore;
      request->spec.sampling.temperature = absl::GetFlag(FLAGS_temperature);
      request->spec.sampling.seed = static_cast<uint64_t>(i) + 1;
      per[i].submitted = Clock::now();
      request->on_update = [&, i, timed](const RequestUpdate& u) {
        if (timed) {
          const auto now = Clock::now();
          std::lock_guard<std::mutex> lock(mu);
          for (size_t k = 0; k < u.new_token_ids.size(); ++k) {
            per[i].arrivals.push_back(now);
          }
        }
        if (u.last()) {
          CHECK(u.status.ok()) << u.status;
          ++done;
        }
      };
      engine.Submit(std::move(request));
    }
    while (done < c) std::this_thread::sleep_for(std::chrono::microseconds(50));
  };
  run("warm", false);
  const EngineSnapshot before = engine.snapshot();
  const auto t0 = Clock::now();
  run("r", true);
  const double seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();
  const EngineSnapshot after = engine.snapshot();
  GenerationFigures f;
  f.tokens_per_second = static_cast<double>(c) * s.tokens / seconds;
  std::vector<double> itl, ttft;
  for (const PerRequest& r : per) {
    if (!r.arrivals.empty()) {
      ttft.push_back(Micros(r.arrivals[0] - r.submitted));
    }
    for (size_t k = 1; k < r.arrivals.size(); ++k) {
      itl.push_back(Micros(r.arrivals[k] - r.arrivals[k - 1]));
    }
  }
  f.itl_us = Summarize(itl);
  f.ttft_us = Summarize(ttft);
  const double busy = after.device_busy_seconds - before.device_busy_seconds;
  const double idle = after.device_idle_seconds - before.device_idle_seconds;
  f.idle_fraction = idle / (busy + idle);
  return f;
}

// 3. The reference router over loopback gRPC: driving step-level Forward
// (the router schedules every step), or sending the request-level Generate
// (the worker owns the decode loop; what SMG sends).
GenerationFigures ViaRouter(const Setup& s, int c, router::RouterApi api) {
  auto device = NewDevice(s);
  auto runner = NewRunner(*device, s);
  const int vocab = static_cast<int>(runner->model_config().vocab_size);
  auto server = WorkerServer::Start(*runner, {}, nullptr);
  CHECK(server.ok()) << server.status();
  CHECK((*server)->CaptureGraphsAndServe().ok());
  router::RouterOptions options;
  options.api = api;
  options.aggregated_addresses = {
      absl::StrCat("127.0.0.1:", (*server)->port())};
  auto r = router::Router::Create(options);
  CHECK(r.ok()) << r.status();

  std::vector<std::vector<int64_t>> itl(c);
  std::vector<double> ttft(c);
  const auto run = [&](const std::string& tag, bool timed) {
    std::vector<std::thread> threads;
    for (int i = 0; i < c; ++i) {
      threads.emplace_back([&, i] {
        router::GenerationRequest request;
        request.request_id = absl::StrCat(tag, i);
        request.prompt = Prompt(i, s.prompt_len, vocab);
        request.max_tokens = s.tokens;
        absl::StatusOr<router::GenerationResult> result =
            (*r)->Generate(request);
        CHECK(result.ok()) << result.status();
        if (timed) {
          itl[i] = result->timings.inter_token_us;
          ttft[i] = static_cast<double>(result->timings.ttft_us);
        }
      });
    }
    for (std::thread& t : threads) t.join();
  };
  run("warm", false);
  const EngineSnapshot before = (*server)->engine().snapshot();
  const auto t0 = Clock::now();
  run("r", true);
  const double seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();
  const EngineSnapshot after = (*server)->engine().snapshot();
  GenerationFigures f;
  f.tokens_per_second = static_cast<double>(c) * s.tokens / seconds;
  const double busy = after.device_busy_seconds - before.device_busy_seconds;
  const double idle = after.device_idle_seconds - before.device_idle_seconds;
  f.idle_fraction = idle / (busy + idle);
  std::vector<double> all;
  for (const auto& v : itl) all.insert(all.end(), v.begin(), v.end());
  f.itl_us = Summarize(all);
  f.ttft_us = Summarize(ttft);
  r->reset();
  (*server)->Drain();
  return f;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Percentiles MedianOf(const std::vector<Percentiles>& runs) {
  std::vector<double> p50, p99;
  for (const Percentiles& r : runs) {
    p50.push_back(r.p50);
    p99.push_back(r.p99);
  }
  return {Median(p50), Median(p99)};
}

// Each field's median over the runs.
GenerationFigures MedianOf(const std::vector<GenerationFigures>& runs) {
  std::vector<double> tps, idle;
  std::vector<Percentiles> ttft, itl;
  for (const GenerationFigures& r : runs) {
    tps.push_back(r.tokens_per_second);
    idle.push_back(r.idle_fraction);
    ttft.push_back(r.ttft_us);
    itl.push_back(r.itl_us);
  }
  GenerationFigures f;
  f.tokens_per_second = Median(tps);
  f.idle_fraction = Median(idle);
  f.ttft_us = MedianOf(ttft);
  f.itl_us = MedianOf(itl);
  return f;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  Setup s;
  s.model_dir = absl::GetFlag(FLAGS_model_dir);
  s.tokens = absl::GetFlag(FLAGS_tokens);
  s.prompt_len = absl::GetFlag(FLAGS_prompt_len);
  s.kv_cache_bytes = int64_t{absl::GetFlag(FLAGS_kv_cache_mib)} << 20;
  const std::string device = absl::GetFlag(FLAGS_device);
  CHECK(device == "cpu" || device == "cuda") << "--device: cpu or cuda";
  s.device = device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  if (!std::ifstream(s.model_dir + "/config.json")) {
    TinyModelOptions model;
    model.shape = TinyShape::kSmall;
    CHECK(WriteTinyModel(model, s.model_dir).ok());
  }
  std::vector<int> concurrency;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int c = 0;
    CHECK(absl::SimpleAtoi(part, &c) && c > 0) << "--concurrency: " << part;
    concurrency.push_back(c);
  }
  s.max_num_seqs = *std::max_element(concurrency.begin(), concurrency.end());

  std::string json = "[";
  std::printf(
      "| concurrent | path | tokens/s | TTFT p50 us | ITL p50 us | ITL p99 us "
      "| ITL p50 / in-process step | device idle between steps |\n"
      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const int rounds = absl::GetFlag(FLAGS_rounds);
  CHECK_GE(rounds, 1) << "--rounds";
  const bool router_paths = absl::GetFlag(FLAGS_router_paths);
  for (const int c : concurrency) {
    // Every path once per round, interleaved, so that a noisy neighbour
    // on a shared machine hits all of them alike; each figure is the
    // median over the rounds.
    std::vector<Percentiles> steps;
    std::vector<GenerationFigures> overlaps, serials, forwards, generates;
    for (int round = 0; round < rounds; ++round) {
      steps.push_back(InProcessStep(s, c));
      overlaps.push_back(EngineRequests(s, c, StepOverlap::kOn));
      serials.push_back(EngineRequests(s, c, StepOverlap::kOff));
      if (!router_paths) continue;
      forwards.push_back(ViaRouter(s, c, router::RouterApi::kStepLevel));
      generates.push_back(ViaRouter(s, c, router::RouterApi::kRequestLevel));
    }
    const Percentiles step = MedianOf(steps);
    const GenerationFigures overlap = MedianOf(overlaps);
    const GenerationFigures serial = MedianOf(serials);
    std::printf(
        "| %d | in-process step (ModelRunner::Execute) | %.0f | | %.0f "
        "| %.0f | 1.00 | |\n",
        c, c * 1e6 / step.p50, step.p50, step.p99);
    const auto row = [&](const char* path, const GenerationFigures& f) {
      std::printf(
          "| %d | %s | %.0f | %.0f | %.0f | %.0f | %.2f | %s |\n", c, path,
          f.tokens_per_second, f.ttft_us.p50, f.itl_us.p50, f.itl_us.p99,
          f.itl_us.p50 / step.p50,
          f.idle_fraction >= 0
              ? absl::StrCat(
                    static_cast<int>(f.idle_fraction * 1000 + 0.5) / 10.0, "%")
                    .c_str()
              : "");
      absl::StrAppend(
          &json, json.size() > 1 ? "," : "", "{\"concurrent\":", c,
          ",\"path\":\"", path,
          "\",\"tokens_per_second\":", f.tokens_per_second,
          ",\"ttft_p50_us\":", f.ttft_us.p50, ",\"itl_p50_us\":", f.itl_us.p50,
          ",\"itl_p99_us\":", f.itl_us.p99, ",\"step_p50_us\":", step.p50,
          ",\"idle_fraction\":", f.idle_fraction, "}");
    };
    row("engine requests, overlap on", overlap);
    row("engine requests, overlap off", serial);
    if (router_paths) {
      row("router driving Forward (gRPC)", MedianOf(forwards));
      row("router sending Generate (gRPC, request-level)", MedianOf(generates));
    }
    // Each concurrency's rows as soon as they exist: a run stopped at its
    // time limit (a device call) still shows them.
    std::fflush(stdout);
  }
  json += "]\n";
  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) std::ofstream(json_out) << json;
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
