// The P/D KV handoff (issue 7), in one run on the `small` tiny config
// (hidden 256, 4 layers, 2 KV heads x head_dim 32, fp32 on the CPU backend:
// 4 x 2 x 2 x 32 x 4 = 2,048 KV bytes per token) with three in-process
// workers on loopback gRPC: prefill (role prefill), decode (role decode) and
// aggregated (role both). For each prompt length and repetition, in turn:
//
//  a. P/D handoff: Forward(start, hold_for_handoff) on the prefill worker,
//     ImportKv on the decode worker, then the first decode step there
//     (Forward(start=false, [first token], release_after_step)).
//  b. Raw PullKv: another prompt prefilled and held, its lease read by a
//     plain KvTransfer client (chunks counted, nothing installed), then
//     ReleaseKv: the transport's network + protobuf cost without the
//     reserve/install work of ImportKv.
//  c. Aggregated: Forward(start) then the first decode step on the role-both
//     worker.
//
// Prints two Markdown tables for bench/RESULTS.md (milliseconds unless
// named): transfer throughput and latency by prompt length for each
// transport the prefill worker offers (KvHandle.transports), and the P/D
// time-to-second-token split (prefill, transfer, first decode step) against
// the aggregated worker, as ratios. --chunk_kib changes the PullKv chunk
// size (default 256 KiB, the worker's default).
//
//   bazel build --config=opt //bench:kv_transfer_bench
//   bazel-bin/bench/kv_transfer_bench [--reps=20] [--prompt_lens=16,64,...]
//
// Everything runs one call at a time, so a transfer never overlaps a model
// step; the three workers and the client share this process and the
// machine's cores. Absolute times are this CPU's; the ratios are the point.
// CPU workers offer only the gRPC stream.
//
// CUDA IPC and NCCL need workers in separate processes (an IPC handle cannot
// be opened by the process that exported it): start three `pdworker`s (roles
// prefill, decode, both; same model; --max_num_batched_tokens at least the
// longest prompt) and point the bench at them:
//
//   kv_transfer_bench --prefill_target=127.0.0.1:50051
//       --decode_target=127.0.0.1:50052 --aggregated_target=127.0.0.1:50053
//       --transports=grpc,cuda_ipc
//
// --transports measures each listed transport in turn by offering only it in
// the handle given to ImportKv (default: whatever ImportKv negotiates).
// --chunk_layouts measures the gRPC stream's token spans and layer runs in
// turn (in-process, a decode worker each; against --decode_target, start
// one per --kv_pull_chunks value and run the bench once for each).
// --decode_loads=0,64 measures idle and again while 64 sequences keep
// decoding on the decode worker.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/gpu_bench_util.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "proto/worker.grpc.pb.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/runner/model_runner.h"
#include "worker/runtime/cpu_device.h"
#include "worker/server/worker_server.h"

ABSL_FLAG(std::vector<std::string>, prompt_lens,
          std::vector<std::string>({"16", "64", "256", "1024", "2048"}),
          "Prompt lengths in tokens (comma-separated).");
ABSL_FLAG(int, reps, 20,
          "Timed repetitions per prompt length (after one "
          "untimed warm-up repetition).");
ABSL_FLAG(int, max_num_batched_tokens, 2048,
          "Step budget of every worker; at least the longest prompt (the "
          "model-step columns need one-step prefills).");
ABSL_FLAG(int, chunk_kib, 256,
          "KvTransferServiceOptions.max_chunk_bytes of the prefill worker, "
          "KiB (token spans: as many tokens as fit; layer runs: whole "
          "16-token blocks).");
ABSL_FLAG(std::vector<std::string>, chunk_layouts,
          std::vector<std::string>({"token_span", "layer_run"}),
          "The gRPC stream's chunk layouts to measure one after the other: "
          "the raw PullKv asks for each, and in-process a decode worker per "
          "layout imports with it (against --decode_target, ImportKv uses "
          "whatever that worker's --kv_pull_chunks says).");
ABSL_FLAG(std::vector<std::string>, decode_loads,
          std::vector<std::string>({"0"}),
          "Sequences the decode worker keeps decoding (one Forward of all of "
          "them after another, from a thread of this process) while the "
          "imports are measured, one setting after the other: 0 = idle.");
ABSL_FLAG(std::string, prefill_target, "",
          "host:port of a running prefill pdworker (with --decode_target and "
          "--aggregated_target); empty: start three workers in-process.");
ABSL_FLAG(std::string, decode_target, "", "host:port of a decode pdworker.");
ABSL_FLAG(std::string, aggregated_target, "",
          "host:port of a role-both pdworker.");
ABSL_FLAG(std::vector<std::string>, transports, {},
          "Transports to measure one after the other (grpc, cuda_ipc, nccl), "
          "each by offering only it in the handle; empty: the negotiated "
          "one.");
ABSL_FLAG(std::string, jsonl, "",
          "Append gpu.jsonl records (DESIGN.md, \"GPU results\") to this "
          "file: kv_import_ms, ttst_ratio and kv_pull_gbps per row, the GPU "
          "named by the decode worker's GetStatus.device.");
ABSL_FLAG(std::string, commit, "", "Commit the binaries were built from.");
ABSL_FLAG(std::string, shape, "llama_1b",
          "The records' shape: the model the workers serve (in-process: "
          "small).");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_bench_small_4k",
          "Where the small model is written (config.json gets "
          "max_position_embeddings 4096 so 2,048-token prompts fit).");

namespace pdworker {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxModelLen = 4096;

double Millis(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// With 20 samples p99 is the largest; `min` is the least disturbed by the
// machine's other load.
struct Percentiles {
  double min = 0, p50 = 0, p99 = 0;
};
Percentiles Summarize(std::vector<double> v) {
  CHECK(!v.empty());
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  };
  return {v.front(), at(0.50), at(0.99)};
}
double P50(const std::vector<double>& v) { return Summarize(v).p50; }

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = (salt * 31 + i * 7 + 3) % 2000;
  return p;
}

// The small shape with max_position_embeddings raised from 512 to 4096 (the
// weights and the model fingerprint do not depend on it; plain RoPE has no
// length limit), so that 1,024- and 2,048-token prompts are allowed.
void WriteModel(const std::string& dir) {
  TinyModelOptions model;
  model.shape = TinyShape::kSmall;
  CHECK(WriteTinyModel(model, dir).ok());
  std::string config = TinyModelConfigJson(model);
  const std::string from = "\"max_position_embeddings\": 512";
  const size_t at = config.find(from);
  CHECK_NE(at, std::string::npos) << config;
  config.replace(at, from.size(),
                 absl::StrCat("\"max_position_embeddings\": ", kMaxModelLen));
  std::ofstream out(dir + "/config.json", std::ios::trunc);
  out << config;
  CHECK(out.good());
}

// A worker this process started (device, runner and server set), or one it
// only connects to (--*_target).
struct Worker {
  CpuDevice device;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<WorkerServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> stub;
  std::unique_ptr<v1::KvTransfer::Stub> transfer;

  v1::WorkerStatus Status() {
    grpc::ClientContext context;
    v1::WorkerStatus status;
    const grpc::Status s =
        stub->GetStatus(&context, v1::GetStatusRequest(), &status);
    CHECK(s.ok()) << s.error_message();
    return status;
  }
};

std::unique_ptr<Worker> StartWorker(
    const std::string& dir, Role role,
    v1::KvChunkLayout pull_chunks = v1::KV_CHUNK_LAYOUT_TOKEN_SPAN) {
  auto w = std::make_unique<Worker>();
  ModelRunnerOptions o;
  o.role = role;  // the role's default graph mode and capture sizes
  // Room for --decode_loads' sequences beside the measured ones.
  o.max_num_seqs = 8;
  for (const std::string& load : absl::GetFlag(FLAGS_decode_loads)) {
    int n = 0;
    if (absl::SimpleAtoi(load, &n))
      o.max_num_seqs = std::max(o.max_num_seqs, n + 8);
  }
  o.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  o.max_model_len = kMaxModelLen;
  o.kv_cache_bytes = int64_t{64} << 20;  // 32k tokens of 2 KiB
  o.block_size = 16;
  auto runner = ModelRunner::Create(w->device, dir, o);
  CHECK(runner.ok()) << runner.status();
  w->runner = std::move(*runner);
  WorkerServerOptions server_options;
  server_options.importer.pull_timeout = std::chrono::seconds(60);
  server_options.importer.stream_chunk_layout = pull_chunks;
  server_options.transfer.max_chunk_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_chunk_kib)) << 10;
  auto server = WorkerServer::Start(*w->runner, server_options, nullptr);
  CHECK(server.ok()) << server.status();
  w->server = std::move(*server);
  const auto t0 = Clock::now();
  auto captured = w->server->CaptureGraphsAndServe();
  CHECK(captured.ok()) << captured.status();
  w->channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", w->server->port()),
                          grpc::InsecureChannelCredentials());
  w->stub = v1::Worker::NewStub(w->channel);
  w->transfer = v1::KvTransfer::NewStub(w->channel);
  const v1::WorkerStatus s = w->Status();
  std::fprintf(stderr,
               "%s worker: mode %s, %d capture sizes (up to %d), %d graphs, "
               "captured in %.1f s\n",
               s.role().c_str(), s.resolved_mode().c_str(),
               s.capture_sizes_size(),
               s.capture_sizes().empty() ? 0 : s.capture_sizes().rbegin()[0],
               s.graphs_captured(),
               std::chrono::duration<double>(Clock::now() - t0).count());
  return w;
}

std::unique_ptr<Worker> ConnectWorker(const std::string& target) {
  auto w = std::make_unique<Worker>();
  w->channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  w->stub = v1::Worker::NewStub(w->channel);
  w->transfer = v1::KvTransfer::NewStub(w->channel);
  // A worker answers GetStatus while it captures graphs; wait until it
  // serves Forward (up to 5 minutes: large models capture for a while).
  const auto give_up = Clock::now() + std::chrono::minutes(5);
  v1::WorkerStatus s;
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    const grpc::Status rpc =
        w->stub->GetStatus(&context, v1::GetStatusRequest(), &s);
    if (rpc.ok() && s.serving()) break;
    CHECK(Clock::now() < give_up)
        << target << " not serving: "
        << (rpc.ok() ? s.DebugString() : rpc.error_message());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::fprintf(stderr, "%s: %s worker, mode %s, %d graphs\n", target.c_str(),
               s.role().c_str(), s.resolved_mode().c_str(),
               s.graphs_captured());
  return w;
}

v1::ForwardResponse Forward(Worker& w, const std::string& id,
                            const std::vector<int32_t>& tokens, bool start,
                            bool hold, bool release, double* ms) {
  v1::ForwardRequest request;
  v1::SequenceInput* in = request.add_sequences();
  in->set_sequence_id(id);
  for (int32_t t : tokens) in->add_token_ids(t);
  in->set_start(start);
  in->set_hold_for_handoff(hold);
  in->set_release_after_step(release);
  grpc::ClientContext context;
  v1::ForwardResponse response;
  const auto t0 = Clock::now();
  const grpc::Status s = w.stub->Forward(&context, request, &response);
  *ms = Millis(Clock::now() - t0);
  CHECK(s.ok()) << s.error_message();
  CHECK_EQ(response.sequences_size(), 1);
  return response;
}

// Model time of a call's steps (the last step's StepInfo.step_micros; the
// prompts here fit one step, checked).
double StepMillis(const v1::ForwardResponse& r) {
  CHECK_EQ(r.num_steps(), 1) << "prompt was chunked";
  return r.step().step_micros() / 1e3;
}

// Until the prefill worker has freed every lease (the decode worker calls
// ReleaseKv just after answering ImportKv) and both workers hold no KV, so
// that one repetition's leftovers never overlap the next one's timings.
// `background`: sequences a DecodeLoad keeps on `w` (their blocks are not
// checked then).
void WaitIdle(Worker& w, int background = 0) {
  const auto give_up = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    const v1::WorkerStatus s = w.Status();
    if (s.kv_leases() == 0 && s.kv_imports() == 0 &&
        s.num_sequences() <= background &&
        (background > 0 || s.kv_blocks_free() == s.kv_blocks_total())) {
      return;
    }
    CHECK(Clock::now() < give_up) << "worker not idle: " << s.DebugString();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// `n` sequences decoding on a worker, from a thread: one Forward of all of
// them after another (the engine runs them as one batch), restarted every
// 256 steps so that they never reach max_model_len. Stopped and released
// on destruction.
class DecodeLoad {
 public:
  DecodeLoad(Worker& w, int n) : w_(w), n_(n) {
    if (n_ > 0) thread_ = std::thread([this] { Run(); });
  }
  ~DecodeLoad() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int steps() const { return steps_; }

 private:
  // Each generation's last step releases its sequences, also when stop_
  // comes mid-generation: a generation left alive would keep its KV on the
  // worker and collide with the next DecodeLoad's ids ("load-G-i").
  void Run() {
    while (!stop_) {
      std::vector<int32_t> next(n_);
      for (int step = 0; step < 256; ++step) {
        const bool last = step == 255 || stop_;
        v1::ForwardRequest request;
        for (int i = 0; i < n_; ++i) {
          v1::SequenceInput* in = request.add_sequences();
          in->set_sequence_id(absl::StrCat("load-", generation_, "-", i));
          if (step == 0) {
            for (int32_t t : Prompt(16, 1000 + i)) in->add_token_ids(t);
          } else {
            in->add_token_ids(next[i]);
          }
          in->set_start(step == 0);
          in->set_release_after_step(last);
        }
        grpc::ClientContext context;
        v1::ForwardResponse response;
        const grpc::Status s = w_.stub->Forward(&context, request, &response);
        CHECK(s.ok()) << "decode load: " << s.error_message();
        for (int i = 0; i < n_; ++i) next[i] = response.sequences(i).token_id();
        ++steps_;
        if (last) break;
      }
      ++generation_;
    }
  }

  Worker& w_;
  const int n_;
  std::atomic<bool> stop_{false};
  std::atomic<int> steps_{0};
  int generation_ = 0;
  std::thread thread_;
};

// One prompt length's samples, milliseconds unless named otherwise.
struct Samples {
  int64_t kv_bytes = 0;
  std::string transport;
  // a. P/D
  std::vector<double> pd_prefill, pd_prefill_step, import_wall, import_server,
      transfer, pd_decode, pd_total;
  std::string chunk_layout;  // the gRPC stream's, for the raw PullKv
  int decode_load = 0;       // sequences decoding beside the imports
  // b. raw PullKv
  std::vector<double> raw_pull;
  int64_t raw_bytes = 0;
  int raw_chunks = 0;
  // c. aggregated
  std::vector<double> agg_prefill, agg_prefill_step, agg_decode, agg_total;
};

class Bench {
 public:
  Bench(Worker& prefill, Worker& decode, Worker& both)
      : prefill_(prefill), decode_(&decode), both_(both) {}

  // Only `transport` is offered to ImportKv from now on ("": all offered).
  void set_transport(const std::string& transport) { transport_ = transport; }
  // Sequences a DecodeLoad keeps on the decode worker from now on.
  void set_decode_load(int n) { decode_load_ = n; }
  // The raw PullKv asks for `layout`; `decode` imports from now on.
  void set_chunk_layout(v1::KvChunkLayout layout, Worker* decode) {
    chunk_layout_ = layout;
    decode_ = decode;
  }

  void Rep(int len, int salt, Samples* out) {
    const std::vector<int32_t> prompt = Prompt(len, salt);
    const std::string id = absl::StrCat("r", salt, "-", len);
    double prefill_ms = 0, decode_ms = 0;

    // a. P/D handoff.
    const v1::ForwardResponse held =
        Forward(prefill_, id, prompt, true, true, false, &prefill_ms);
    const v1::KvHandle& handle = held.sequences(0).kv_handle();
    CHECK_EQ(handle.num_tokens(), len);
    offered_transports_.assign(handle.transports().begin(),
                               handle.transports().end());
    v1::ImportKvRequest import;
    import.set_sequence_id(id);
    *import.mutable_handle() = handle;
    if (!transport_.empty()) {
      CHECK(std::find(handle.transports().begin(), handle.transports().end(),
                      transport_) != handle.transports().end())
          << "the prefill worker does not offer " << transport_;
      import.mutable_handle()->clear_transports();
      import.mutable_handle()->add_transports(transport_);
    }
    v1::ImportKvResponse imported;
    grpc::ClientContext import_context;
    const auto t0 = Clock::now();
    const grpc::Status s =
        decode_->stub->ImportKv(&import_context, import, &imported);
    const double import_ms = Millis(Clock::now() - t0);
    CHECK(s.ok()) << s.error_message();
    CHECK_EQ(imported.num_tokens(), len);
    if (!transport_.empty()) CHECK_EQ(imported.transport(), transport_);
    const v1::ForwardResponse first =
        Forward(*decode_, id, {held.sequences(0).token_id()}, false, false,
                true, &decode_ms);
    if (out != nullptr) {
      out->kv_bytes = imported.transfer_bytes();
      out->transport = imported.transport();
      out->pd_prefill.push_back(prefill_ms);
      out->pd_prefill_step.push_back(StepMillis(held));
      out->import_wall.push_back(import_ms);
      out->import_server.push_back(imported.import_micros() / 1e3);
      out->transfer.push_back(imported.transfer_micros() / 1e3);
      out->pd_decode.push_back(decode_ms);
      out->pd_total.push_back(prefill_ms + import_ms + decode_ms);
    }
    WaitIdle(prefill_);
    WaitIdle(*decode_, decode_load_);

    // b. Raw PullKv: read the chunks, install nothing.
    const v1::ForwardResponse held2 =
        Forward(prefill_, id + "-raw", prompt, true, true, false, &prefill_ms);
    const v1::KvHandle& raw_handle = held2.sequences(0).kv_handle();
    v1::PullKvRequest pull;
    pull.set_lease_id(raw_handle.lease_id());
    pull.set_model_fingerprint(raw_handle.model_fingerprint());
    *pull.mutable_layout() = raw_handle.layout();
    pull.set_chunk_layout(chunk_layout_);
    grpc::ClientContext pull_context;
    v1::KvChunk chunk;
    int64_t bytes = 0;
    int chunks = 0;
    const auto t1 = Clock::now();
    std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
        prefill_.transfer->PullKv(&pull_context, pull);
    while (reader->Read(&chunk)) {
      bytes += static_cast<int64_t>(chunk.data().size());
      ++chunks;
    }
    const grpc::Status pulled = reader->Finish();
    const double pull_ms = Millis(Clock::now() - t1);
    CHECK(pulled.ok()) << pulled.error_message();
    grpc::ClientContext release_context;
    v1::ReleaseKvRequest release;
    release.set_lease_id(raw_handle.lease_id());
    v1::ReleaseKvResponse released;
    const grpc::Status r =
        prefill_.transfer->ReleaseKv(&release_context, release, &released);
    CHECK(r.ok()) << r.error_message();
    if (out != nullptr) {
      out->raw_pull.push_back(pull_ms);
      out->raw_bytes = bytes;
      out->raw_chunks = chunks;
      out->decode_load = decode_load_;
      out->chunk_layout = chunk_layout_ == v1::KV_CHUNK_LAYOUT_TOKEN_SPAN
                              ? "token_span"
                              : "layer_run";
    }
    WaitIdle(prefill_);

    // c. Aggregated.
    const v1::ForwardResponse agg =
        Forward(both_, id, prompt, true, false, false, &prefill_ms);
    CHECK_EQ(agg.sequences(0).token_id(), held.sequences(0).token_id());
    const v1::ForwardResponse agg_first =
        Forward(both_, id, {agg.sequences(0).token_id()}, false, false, true,
                &decode_ms);
    // Same model, same greedy sampling: the handoff must not change tokens.
    CHECK_EQ(agg_first.sequences(0).token_id(), first.sequences(0).token_id());
    if (out != nullptr) {
      out->agg_prefill.push_back(prefill_ms);
      out->agg_prefill_step.push_back(StepMillis(agg));
      out->agg_decode.push_back(decode_ms);
      out->agg_total.push_back(prefill_ms + decode_ms);
    }
    WaitIdle(both_);
  }

  const std::vector<std::string>& offered_transports() const {
    return offered_transports_;
  }

 private:
  Worker& prefill_;
  Worker* decode_;
  Worker& both_;
  v1::KvChunkLayout chunk_layout_ = v1::KV_CHUNK_LAYOUT_TOKEN_SPAN;
  int decode_load_ = 0;
  std::vector<std::string> offered_transports_;  // KvHandle.transports
  std::string transport_;
};

double MBps(int64_t bytes, double ms) { return bytes / (ms * 1e3); }

// A row's transport, with the chunk layout where there are chunks.
std::string Label(const Samples& s) {
  std::string label = s.transport == "grpc"
                          ? absl::StrCat("grpc ", s.chunk_layout)
                          : s.transport;
  if (s.decode_load > 0) {
    absl::StrAppend(&label, ", decode busy with ", s.decode_load, " seqs");
  }
  return label;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  std::vector<int> lens;
  for (const std::string& s : absl::GetFlag(FLAGS_prompt_lens)) {
    int n = 0;
    // In-process workers take prompts below kMaxModelLen; running ones
    // their own --max_model_len.
    CHECK(absl::SimpleAtoi(s, &n) && n > 0 &&
          (n < kMaxModelLen || !absl::GetFlag(FLAGS_prefill_target).empty()))
        << s;
    CHECK_LE(n, absl::GetFlag(FLAGS_max_num_batched_tokens))
        << "--prompt_lens: " << n << " would be chunked";
    lens.push_back(n);
  }
  const int reps = absl::GetFlag(FLAGS_reps);
  CHECK_GT(reps, 0);
  std::vector<v1::KvChunkLayout> chunk_layouts;
  for (const std::string& name : absl::GetFlag(FLAGS_chunk_layouts)) {
    CHECK(name == "token_span" || name == "layer_run")
        << "--chunk_layouts: " << name;
    chunk_layouts.push_back(name == "token_span"
                                ? v1::KV_CHUNK_LAYOUT_TOKEN_SPAN
                                : v1::KV_CHUNK_LAYOUT_LAYER_RUN);
  }
  CHECK(!chunk_layouts.empty()) << "--chunk_layouts is empty";
  std::unique_ptr<Worker> prefill, decode, both;
  // In-process: a decode worker per chunk layout (the first is `decode`).
  std::vector<std::unique_ptr<Worker>> other_decodes;
  const std::string prefill_target = absl::GetFlag(FLAGS_prefill_target);
  if (prefill_target.empty()) {
    const std::string dir = absl::GetFlag(FLAGS_model_dir);
    WriteModel(dir);
    prefill = StartWorker(dir, Role::kPrefill);
    decode = StartWorker(dir, Role::kDecode, chunk_layouts[0]);
    for (size_t i = 1; i < chunk_layouts.size(); ++i) {
      other_decodes.push_back(
          StartWorker(dir, Role::kDecode, chunk_layouts[i]));
    }
    both = StartWorker(dir, Role::kBoth);
  } else {
    CHECK(!absl::GetFlag(FLAGS_decode_target).empty() &&
          !absl::GetFlag(FLAGS_aggregated_target).empty())
        << "--prefill_target needs --decode_target and --aggregated_target";
    prefill = ConnectWorker(prefill_target);
    decode = ConnectWorker(absl::GetFlag(FLAGS_decode_target));
    both = ConnectWorker(absl::GetFlag(FLAGS_aggregated_target));
  }
  const v1::KvLayout layout = [&] {
    double ms = 0;
    const v1::ForwardResponse r =
        Forward(*prefill, "layout", {1}, true, true, false, &ms);
    grpc::ClientContext context;
    v1::ReleaseKvRequest release;
    release.set_lease_id(r.sequences(0).kv_handle().lease_id());
    v1::ReleaseKvResponse released;
    CHECK(prefill->transfer->ReleaseKv(&context, release, &released).ok());
    return r.sequences(0).kv_handle().layout();
  }();
  const int64_t token_bytes = int64_t{2} * layout.num_layers() *
                              layout.num_kv_heads() * layout.head_dim() *
                              (layout.dtype() == "float32" ? 4 : 2);

  Bench bench(*prefill, *decode, *both);
  std::vector<std::string> transports = absl::GetFlag(FLAGS_transports);
  if (transports.empty()) transports.push_back("");  // negotiated
  // One row per (transport, prompt length), transports outermost.
  std::vector<Samples> results;
  std::vector<int> row_lens;
  int salt = 0;
  std::vector<int> loads;
  for (const std::string& text : absl::GetFlag(FLAGS_decode_loads)) {
    int n = 0;
    CHECK(absl::SimpleAtoi(text, &n) && n >= 0) << "--decode_loads: " << text;
    loads.push_back(n);
  }
  for (const int load : loads) {
    bench.set_decode_load(load);
    for (const std::string& transport : transports) {
      bench.set_transport(transport);
      for (size_t c = 0; c < chunk_layouts.size(); ++c) {
        // Chunks exist only on the gRPC stream: one layout for the others.
        if (c > 0 && !transport.empty() && transport != "grpc") break;
        Worker* importer = c == 0 || other_decodes.empty()
                               ? decode.get()
                               : other_decodes[c - 1].get();
        bench.set_chunk_layout(chunk_layouts[c], importer);
        const DecodeLoad busy(*importer, load);
        for (const int len : lens) {
          const auto t0 = Clock::now();
          Samples samples;
          bench.Rep(len, ++salt, nullptr);  // warm-up
          for (int r = 0; r < reps; ++r) bench.Rep(len, ++salt, &samples);
          CHECK_EQ(samples.kv_bytes, token_bytes * len);
          CHECK_EQ(samples.raw_bytes, samples.kv_bytes);
          std::fprintf(stderr,
                       "%s prompt %d: %d reps in %.1f s (%d load steps)\n",
                       Label(samples).c_str(), len, reps,
                       std::chrono::duration<double>(Clock::now() - t0).count(),
                       busy.steps());
          results.push_back(std::move(samples));
          row_lens.push_back(len);
        }
      }
    }
  }
  std::printf(
      "KV layout: %d layers x (K + V) x %d KV heads x head_dim %d, %s: "
      "%lld bytes per token. Transports offered by the prefill worker: %s. "
      "%d repetitions per row.\n\n",
      layout.num_layers(), layout.num_kv_heads(), layout.head_dim(),
      layout.dtype().c_str(), static_cast<long long>(token_bytes),
      absl::StrJoin(bench.offered_transports(), ", ").c_str(), reps);

  // 1. Transfer by prompt length.
  std::printf(
      "| transport | prompt tokens | KV bytes per handoff | ImportKv p50 | "
      "ImportKv p99 | import_micros p50 | transfer_micros p50 | transfer "
      "MB/s at p50 | transfer MB/s at min | reserve + install p50 | raw "
      "PullKv p50 | raw PullKv p99 | raw PullKv MB/s at p50 | raw PullKv "
      "MB/s at min | chunks |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
      "| ---: | ---: | ---: | ---: | ---: |\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Samples& s = results[i];
    const Percentiles wall = Summarize(s.import_wall);
    const Percentiles transfer = Summarize(s.transfer);
    const Percentiles raw = Summarize(s.raw_pull);
    std::vector<double> install;
    for (size_t k = 0; k < s.transfer.size(); ++k) {
      install.push_back(s.import_server[k] - s.transfer[k]);
    }
    std::printf(
        "| %s | %d | %lld | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f | %.2f | "
        "%.2f | %.2f | %.0f | %.0f | %d |\n",
        Label(s).c_str(), row_lens[i], static_cast<long long>(s.kv_bytes),
        wall.p50, wall.p99, P50(s.import_server), transfer.p50,
        MBps(s.kv_bytes, transfer.p50), MBps(s.kv_bytes, transfer.min),
        P50(install), raw.p50, raw.p99, MBps(s.raw_bytes, raw.p50),
        MBps(s.raw_bytes, raw.min), s.raw_chunks);
  }
  // The transports DESIGN.md names that this pair of workers did not offer
  // (CPU workers offer only the gRPC stream).
  for (const char* transport : {"grpc", "cuda_ipc", "nccl"}) {
    if (std::find(bench.offered_transports().begin(),
                  bench.offered_transports().end(),
                  transport) != bench.offered_transports().end()) {
      continue;
    }
    std::printf(
        "| %s | | | not offered by the prefill worker | | | | | | | | | | | "
        "|\n",
        transport);
  }
  std::printf("\n");

  // 2. Time to the second token: P/D vs aggregated. The first token is
  // sampled by the prefill Forward on both paths; P/D adds the transfer
  // before the second.
  std::printf(
      "| transport | prompt tokens | P/D prefill Forward (hold) | its model "
      "step | "
      "ImportKv | P/D first decode | P/D total | aggregated prefill Forward "
      "| its model step | aggregated first decode | aggregated total | P/D / "
      "aggregated | ImportKv / aggregated total |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
      "| ---: | ---: | ---: |\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Samples& s = results[i];
    std::printf(
        "| %s | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | "
        "%.2f | %.2f | %.3f |\n",
        Label(s).c_str(), row_lens[i], P50(s.pd_prefill),
        P50(s.pd_prefill_step), P50(s.import_wall), P50(s.pd_decode),
        P50(s.pd_total), P50(s.agg_prefill), P50(s.agg_prefill_step),
        P50(s.agg_decode), P50(s.agg_total), P50(s.pd_total) / P50(s.agg_total),
        P50(s.import_wall) / P50(s.agg_total));
  }
  const std::string jsonl = absl::GetFlag(FLAGS_jsonl);
  if (!jsonl.empty()) {
    // "cuda:0 (NVIDIA H200)" -> "NVIDIA H200".
    std::string gpu = decode->Status().device();
    const size_t open = gpu.find('('), close = gpu.rfind(')');
    if (open != std::string::npos && close != std::string::npos &&
        close > open) {
      gpu = gpu.substr(open + 1, close - open - 1);
    }
    std::vector<nlohmann::json> records;
    for (size_t i = 0; i < results.size(); ++i) {
      const Samples& s = results[i];
      std::string system = s.transport == "grpc"
                               ? absl::StrCat("grpc_", s.chunk_layout)
                               : s.transport;
      for (const auto& [metric, value] :
           std::vector<std::pair<const char*, double>>{
               {"kv_import_ms", P50(s.import_wall)},
               {"ttst_ratio", P50(s.pd_total) / P50(s.agg_total)},
               {"kv_pull_gbps", s.raw_bytes / (P50(s.raw_pull) * 1e6)}}) {
        records.push_back({{"metric", metric},
                           {"shape", absl::GetFlag(FLAGS_prefill_target).empty()
                                         ? "small"
                                         : absl::GetFlag(FLAGS_shape)},
                           {"system", system},
                           {"batch", 1},
                           {"tokens", row_lens[i]},
                           {"context", row_lens[i]},
                           {"decode_load", s.decode_load},
                           {"value", value}});
      }
    }
    AppendGpuRecords(jsonl, gpu, absl::GetFlag(FLAGS_commit),
                     std::move(records));
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) { return pdworker::Main(argc, argv); }
