// What the gRPC layer costs and what coalescing buys, in one run on the
// `small` tiny config (hidden 256, 4 layers) on the CPU backend:
//
//  1. Forward overhead over the in-process step: one-sequence greedy decode
//     steps timed around ModelRunner::Execute, then the same steps as Forward
//     calls over loopback gRPC (1 client), p50/p99 in microseconds.
//  2. 64 clients, one sequence each, decoding concurrently: per-call latency
//     and total decode throughput when the worker merges their calls into
//     batched steps (max_num_seqs=64) and when it runs them one by one
//     (max_num_seqs=1), plus the in-process 64-sequence step as the bound.
//
//   bazel build --config=opt //bench:forward_rpc_bench
//   bazel-bin/bench/forward_rpc_bench [--decode_steps=N]
//
// Prints Markdown for bench/RESULTS.md. The absolute times are this CPU's;
// the ratios are the point.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/worker.grpc.pb.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"
#include "worker/server/worker_server.h"

ABSL_FLAG(int, decode_steps, 100,
          "Decode steps per sequence (after a 16-token prompt).");
ABSL_FLAG(int, single_rounds, 10,
          "Sequences decoded one after another for the 1-client figures.");
ABSL_FLAG(int, clients, 64, "Concurrent clients for the coalescing figures.");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_small",
          "Where the small model is written.");

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPromptLen = 16;

double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Percentiles {
  double p50 = 0, p99 = 0;
};
Percentiles Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  };
  return {at(0.50), at(0.99)};
}

std::vector<int32_t> Prompt(int seed) {
  std::vector<int32_t> p(kPromptLen);
  for (int i = 0; i < kPromptLen; ++i) p[i] = (seed * 31 + i * 7) % 2000;
  return p;
}

ModelRunnerOptions Options(int max_num_seqs) {
  ModelRunnerOptions o;
  o.role = Role::kBoth;  // FULL_AND_PIECEWISE: decode steps replay FULL graphs
  o.max_num_seqs = max_num_seqs;
  o.max_num_batched_tokens = 2048;
  o.max_model_len = 512;
  o.kv_cache_bytes = int64_t{128} << 20;
  o.block_size = 16;
  return o;
}

std::unique_ptr<ModelRunner> MakeRunner(Device& device, const std::string& dir,
                                        int max_num_seqs) {
  auto runner = ModelRunner::Create(device, dir, Options(max_num_seqs));
  CHECK(runner.ok()) << runner.status();
  CHECK((*runner)->CaptureGraphs().ok());
  return std::move(*runner);
}

// In-process: `rounds` sequences, each a prompt then `steps` timed decodes.
std::vector<double> InProcessDecodes(ModelRunner& r, int rounds, int steps) {
  std::vector<double> us;
  for (int round = 0; round < rounds; ++round) {
    const std::string id = absl::StrCat("inproc", round);
    auto result = r.Execute(
        {MakeSequenceStep(id, Prompt(round), SequenceCreation::kMustBeNew)});
    CHECK(result.ok());
    int32_t token = result->sequences[0].token_id;
    for (int s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      result = r.Execute(
          {MakeSequenceStep(id, {token}, SequenceCreation::kMustExist)});
      us.push_back(Micros(Clock::now() - t0));
      CHECK(result.ok());
      token = result->sequences[0].token_id;
    }
    CHECK(r.Release(id).ok());
  }
  return us;
}

// Per decode call: client-side latency, and that minus the model time of
// the step that answered it (StepInfo.step_micros) — what the call spent in
// gRPC, the queue and the engine.
struct CallTimes {
  std::vector<double> latency_us;
  std::vector<double> overhead_us;
  void Append(const CallTimes& o) {
    latency_us.insert(latency_us.end(), o.latency_us.begin(),
                      o.latency_us.end());
    overhead_us.insert(overhead_us.end(), o.overhead_us.begin(),
                       o.overhead_us.end());
  }
};

// Over gRPC: one client runs `rounds` sequences like InProcessDecodes.
CallTimes RpcDecodes(v1::Worker::Stub& stub, const std::string& tag, int rounds,
                     int steps) {
  CallTimes times;
  for (int round = 0; round < rounds; ++round) {
    const std::string id = absl::StrCat(tag, round);
    int32_t token = -1;
    for (int s = 0; s <= steps; ++s) {
      v1::ForwardRequest request;
      v1::SequenceInput* in = request.add_sequences();
      in->set_sequence_id(id);
      if (s == 0) {
        for (int32_t t : Prompt(round)) in->add_token_ids(t);
        in->set_start(true);
      } else {
        in->add_token_ids(token);
      }
      in->set_release_after_step(s == steps);
      grpc::ClientContext context;
      v1::ForwardResponse response;
      const auto t0 = Clock::now();
      const grpc::Status status = stub.Forward(&context, request, &response);
      const double us = Micros(Clock::now() - t0);
      CHECK(status.ok()) << status.error_message();
      if (s > 0) {
        times.latency_us.push_back(us);
        times.overhead_us.push_back(us - response.step().step_micros());
      }
      token = response.sequences(0).token_id();
    }
  }
  return times;
}

struct ServerUnderTest {
  CpuDevice device;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<WorkerServer> server;
  std::shared_ptr<grpc::Channel> channel;
};

std::unique_ptr<ServerUnderTest> StartServer(const std::string& dir,
                                             int max_num_seqs) {
  auto s = std::make_unique<ServerUnderTest>();
  s->runner = MakeRunner(s->device, dir, max_num_seqs);
  auto server = WorkerServer::Start(*s->runner, {}, nullptr);
  CHECK(server.ok()) << server.status();
  s->server = std::move(*server);
  CHECK(s->server->CaptureGraphsAndServe().ok());
  s->channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", s->server->port()),
                          grpc::InsecureChannelCredentials());
  return s;
}

struct ConcurrentResult {
  Percentiles latency_us;
  Percentiles overhead_us;
  double tokens_per_second = 0;
  double mean_sequences_per_step = 0;
};

// `clients` threads, each a prompt then `steps` decodes of its own sequence.
ConcurrentResult ConcurrentDecodes(ServerUnderTest& s, int clients, int steps) {
  std::vector<CallTimes> per_client(clients);
  std::vector<std::thread> threads;
  threads.reserve(clients);
  const int64_t steps_before = s.server->engine().snapshot().steps;
  const auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto stub = v1::Worker::NewStub(s.channel);
      per_client[c] = RpcDecodes(*stub, absl::StrCat("c", c, "-"), 1, steps);
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t steps_run = s.server->engine().snapshot().steps - steps_before;
  CallTimes all;
  for (const CallTimes& c : per_client) all.Append(c);
  ConcurrentResult r;
  r.latency_us = Summarize(all.latency_us);
  r.overhead_us = Summarize(all.overhead_us);
  r.tokens_per_second = clients * (steps + 1) / seconds;
  r.mean_sequences_per_step =
      static_cast<double>(clients) * (steps + 1) / steps_run;
  return r;
}

// In-process bound: all `clients` sequences in every step.
double InProcessBatchedTokensPerSecond(ModelRunner& r, int clients, int steps) {
  std::vector<SequenceStep> batch;
  batch.reserve(clients);
  for (int c = 0; c < clients; ++c) {
    batch.push_back(MakeSequenceStep(absl::StrCat("b", c), Prompt(c),
                                     SequenceCreation::kMustBeNew));
  }
  const auto t0 = Clock::now();
  auto result = r.Execute(batch);
  CHECK(result.ok());
  for (int s = 0; s < steps; ++s) {
    for (int c = 0; c < clients; ++c) {
      batch[c].token_ids = {result->sequences[c].token_id};
      batch[c].creation = SequenceCreation::kMustExist;
    }
    result = r.Execute(batch);
    CHECK(result.ok());
  }
  const double seconds =
      std::chrono::duration<double>(Clock::now() - t0).count();
  for (int c = 0; c < clients; ++c) CHECK(r.Release(absl::StrCat("b", c)).ok());
  return clients * (steps + 1) / seconds;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  TinyModelOptions model;
  model.shape = TinyShape::kSmall;
  CHECK(WriteTinyModel(model, dir).ok());
  const int steps = absl::GetFlag(FLAGS_decode_steps);
  const int rounds = absl::GetFlag(FLAGS_single_rounds);
  const int clients = absl::GetFlag(FLAGS_clients);

  // 1. One client.
  Percentiles in_process, rpc, rpc_overhead;
  double in_process_tokens_per_second = 0;
  {
    CpuDevice device;
    auto runner = MakeRunner(device, dir, clients);
    InProcessDecodes(*runner, 1, steps);  // warm-up
    const std::vector<double> us = InProcessDecodes(*runner, rounds, steps);
    in_process = Summarize(us);
    double total = 0;
    for (double u : us) total += u;
    in_process_tokens_per_second = 1e6 * us.size() / total;
  }
  {
    auto s = StartServer(dir, clients);
    auto stub = v1::Worker::NewStub(s->channel);
    RpcDecodes(*stub, "warm", 1, steps);
    const CallTimes times = RpcDecodes(*stub, "one", rounds, steps);
    rpc = Summarize(times.latency_us);
    rpc_overhead = Summarize(times.overhead_us);
  }
  std::printf(
      "| one client, 1-sequence decode step | p50 us | p99 us |\n"
      "| --- | ---: | ---: |\n"
      "| in-process ModelRunner::Execute | %.0f | %.0f |\n"
      "| Forward over loopback gRPC | %.0f | %.0f |\n"
      "| Forward minus its step's time (gRPC + queue + engine) | %.0f | "
      "%.0f |\n"
      "| ratio Forward / in-process | %.2f | %.2f |\n\n",
      in_process.p50, in_process.p99, rpc.p50, rpc.p99, rpc_overhead.p50,
      rpc_overhead.p99, rpc.p50 / in_process.p50, rpc.p99 / in_process.p99);

  // 2. Many clients, coalesced vs one by one.
  ConcurrentResult coalesced, one_by_one;
  double bound = 0;
  {
    auto s = StartServer(dir, clients);
    ConcurrentDecodes(*s, clients, 10);  // warm-up
    coalesced = ConcurrentDecodes(*s, clients, steps);
  }
  {
    auto s = StartServer(dir, 1);
    one_by_one = ConcurrentDecodes(*s, clients, steps);
  }
  {
    CpuDevice device;
    auto runner = MakeRunner(device, dir, clients);
    InProcessBatchedTokensPerSecond(*runner, clients, 10);
    bound = InProcessBatchedTokensPerSecond(*runner, clients, steps);
  }
  std::printf(
      "| %d clients, 1 sequence each | call p50 us | call p99 us | "
      "call minus step p50 us | call minus step p99 us | sequences per "
      "step | tokens/s | vs one by one |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
      "| coalesced (max_num_seqs=%d) | %.0f | %.0f | %.0f | %.0f | %.1f | "
      "%.0f | %.2f |\n"
      "| one by one (max_num_seqs=1) | %.0f | %.0f | %.0f | %.0f | %.1f | "
      "%.0f | 1.00 |\n"
      "| in-process, %d sequences per step | | | | | %d | %.0f | %.2f |\n"
      "| in-process, 1 sequence per step | | | | | 1 | %.0f | %.2f |\n",
      clients, clients, coalesced.latency_us.p50, coalesced.latency_us.p99,
      coalesced.overhead_us.p50, coalesced.overhead_us.p99,
      coalesced.mean_sequences_per_step, coalesced.tokens_per_second,
      coalesced.tokens_per_second / one_by_one.tokens_per_second,
      one_by_one.latency_us.p50, one_by_one.latency_us.p99,
      one_by_one.overhead_us.p50, one_by_one.overhead_us.p99,
      one_by_one.mean_sequences_per_step, one_by_one.tokens_per_second, clients,
      clients, bound, bound / one_by_one.tokens_per_second,
      in_process_tokens_per_second,
      in_process_tokens_per_second / one_by_one.tokens_per_second);
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
