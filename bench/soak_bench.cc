// Soak (issue 25 item 10): a real pdworker process under steady load from
// many clients for a long time, sampled every minute: resident memory, open
// file descriptors and threads of the worker process (/proc), KV blocks in
// use and live sequences (GetStatus), calls and errors so far. Half the
// clients drive step-level Forward (start, decode steps, release with the
// last step), half stream request-level Generate. The goal: 0 errors, and
// every process series flat within +-5% after warm-up.
//
//   bazel build --config=opt //bench:soak_bench //worker:pdworker
//   bazel-bin/bench/soak_bench --pdworker=bazel-bin/worker/pdworker
//       --minutes=30 --clients=64   (one line)
//
// Prints a Markdown table (one row per sample) and a summary for
// bench/RESULTS.md. CPU backend, `small` tiny model.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/vllm_engine.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tools/make_tiny_model/tiny_model.h"

ABSL_FLAG(std::string, pdworker, "bazel-bin/worker/pdworker",
          "The worker binary to soak.");
ABSL_FLAG(std::string, model_dir, "/tmp/pdworker_soak_small",
          "Where the small model is written.");
ABSL_FLAG(int, minutes, 30, "How long the load runs.");
ABSL_FLAG(int, sample_seconds, 60, "Sampling period.");
ABSL_FLAG(int, warmup_samples, 2,
          "Samples left out of the flatness check (warm-up).");
ABSL_FLAG(int, clients, 64,
          "Concurrent clients; half Forward-driven, half Generate streams.");
ABSL_FLAG(int, prompt_tokens, 24, "Prompt length per generation.");
ABSL_FLAG(int, output_tokens, 32, "Tokens generated per generation.");

namespace pdworker {
namespace {

namespace vg = ::vllm::grpc::engine;
using Clock = std::chrono::steady_clock;

// The worker process: started with stdout on a pipe (for "listening on").
struct Worker {
  pid_t pid = -1;
  int port = 0;
};

Worker StartWorker(const std::string& binary, const std::string& model_dir,
                   const std::string& log_path) {
  int out[2];
  PCHECK(pipe(out) == 0);
  const pid_t pid = fork();
  PCHECK(pid >= 0);
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    FILE* log = fopen(log_path.c_str(), "w");
    if (log != nullptr) dup2(fileno(log), STDERR_FILENO);
    close(out[0]);
    const std::string model = "--model=" + model_dir;
    execl(binary.c_str(), binary.c_str(), model.c_str(), "--role=both",
          "--host=127.0.0.1", "--port=0", "--metrics_port=-1",
          "--max_num_seqs=64", "--max_num_batched_tokens=512",
          "--kv_cache_bytes=67108864", "--stats_log_interval=0",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  Worker w;
  w.pid = pid;
  std::string seen;
  char buf[256];
  while (w.port == 0) {
    const ssize_t n = read(out[0], buf, sizeof(buf));
    CHECK_GT(n, 0) << "pdworker exited before listening; see " << log_path;
    seen.append(buf, static_cast<size_t>(n));
    const size_t at = seen.find("listening on ");
    const size_t end = seen.find('\n', at);
    if (at != std::string::npos && end != std::string::npos) {
      CHECK(absl::SimpleAtoi(seen.substr(at + 13, end - at - 13), &w.port));
    }
  }
  close(out[0]);
  return w;
}

// /proc/<pid>/status field in its unit (kB for VmRSS), or -1.
int64_t ProcStatus(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::istringstream rest(line.substr(field.size() + 1));
    int64_t value = -1;
    rest >> value;
    return value;
  }
  return -1;
}

int64_t OpenFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

struct Counters {
  std::atomic<int64_t> generations{0};
  std::atomic<int64_t> tokens{0};
  std::atomic<int64_t> errors{0};
};

std::vector<int32_t> Prompt(int client, int64_t round, int n) {
  std::vector<int32_t> p(n);
  uint32_t x = 2654435761u * static_cast<uint32_t>(client + 1) +
               static_cast<uint32_t>(round);
  for (int i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = 3 + static_cast<int32_t>(x % 250);
  }
  return p;
}

void RecordError(Counters& c, const grpc::Status& s, const char* what) {
  if (c.errors.fetch_add(1) < 10) {
    LOG(WARNING) << what << ": " << s.error_code() << " " << s.error_message();
  }
}

// Step-level: start with the prompt, one Forward per decode step, the
// last one releasing the sequence.
void ForwardClient(std::shared_ptr<grpc::Channel> channel, int client,
                   const std::atomic<bool>& stop, Counters& c) {
  auto stub = v1::Worker::NewStub(channel);
  const int out_tokens = absl::GetFlag(FLAGS_output_tokens);
  for (int64_t round = 0; !stop.load(); ++round) {
    const std::string id = absl::StrCat("soak-f", client, "-", round);
    int32_t token = 0;
    bool ok = true;
    for (int step = 0; step < out_tokens && ok; ++step) {
      v1::ForwardRequest request;
      v1::SequenceInput* in = request.add_sequences();
      in->set_sequence_id(id);
      if (step == 0) {
        in->set_start(true);
        for (int32_t t :
             Prompt(client, round, absl::GetFlag(FLAGS_prompt_tokens))) {
          in->add_token_ids(t);
        }
      } else {
        in->add_token_ids(token);
      }
      in->set_release_after_step(step == out_tokens - 1);
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::seconds(60));
      v1::ForwardResponse response;
      const grpc::Status s = stub->Forward(&context, request, &response);
      if (!s.ok()) {
        RecordError(c, s, "Forward");
        ok = false;
        // Free the sequence if it exists (a failed start holds nothing).
        grpc::ClientContext release_context;
        v1::ReleaseRequest release;
        release.add_sequence_ids(id);
        v1::ReleaseResponse released;
        (void)stub->Release(&release_context, release, &released);
        break;
      }
      token = response.sequences(0).token_id();
      c.tokens.fetch_add(1);
    }
    if (ok) c.generations.fetch_add(1);
  }
}

// Request-level: one streamed Generate per generation.
void GenerateClient(std::shared_ptr<grpc::Channel> channel, int client,
                    const std::atomic<bool>& stop, Counters& c) {
  auto stub = vg::VllmEngine::NewStub(channel);
  for (int64_t round = 0; !stop.load(); ++round) {
    vg::GenerateRequest request;
    request.set_request_id(absl::StrCat("soak-g", client, "-", round));
    for (int32_t t :
         Prompt(client, round, absl::GetFlag(FLAGS_prompt_tokens))) {
      request.mutable_tokenized()->add_input_ids(t);
    }
    request.set_stream(true);
    vg::SamplingParams* p = request.mutable_sampling_params();
    p->set_temperature(0.0f);
    p->set_max_tokens(absl::GetFlag(FLAGS_output_tokens));
    p->set_ignore_eos(true);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(120));
    auto reader = stub->Generate(&context, request);
    vg::GenerateResponse response;
    while (reader->Read(&response)) {
      if (response.has_chunk()) {
        c.tokens.fetch_add(response.chunk().token_ids_size());
      }
    }
    const grpc::Status s = reader->Finish();
    if (s.ok()) {
      c.generations.fetch_add(1);
    } else {
      RecordError(c, s, "Generate");
    }
  }
}

struct Sample {
  double minutes = 0;
  int64_t rss_kb = 0, fds = 0, threads = 0;
  int64_t kv_used_blocks = 0, sequences = 0;
  int64_t generations = 0, tokens = 0, errors = 0;
};

Sample TakeSample(pid_t pid, v1::Worker::Stub& stub, Clock::time_point start,
                  const Counters& c) {
  Sample s;
  s.minutes = std::chrono::duration<double>(Clock::now() - start).count() / 60;
  s.rss_kb = ProcStatus(pid, "VmRSS");
  s.threads = ProcStatus(pid, "Threads");
  s.fds = OpenFds(pid);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::WorkerStatus status;
  if (stub.GetStatus(&context, v1::GetStatusRequest(), &status).ok()) {
    s.kv_used_blocks = status.kv_blocks_total() - status.kv_blocks_free();
    s.sequences = status.num_sequences();
  }
  s.generations = c.generations.load();
  s.tokens = c.tokens.load();
  s.errors = c.errors.load();
  return s;
}

// Largest deviation from the median, in percent, over samples[from..].
double Spread(const std::vector<Sample>& samples, size_t from,
              int64_t Sample::*field) {
  std::vector<int64_t> v;
  for (size_t i = from; i < samples.size(); ++i) {
    v.push_back(samples[i].*field);
  }
  if (v.empty()) return 0;
  std::vector<int64_t> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  const double median = static_cast<double>(sorted[sorted.size() / 2]);
  if (median == 0) return 0;
  double worst = 0;
  for (int64_t x : v) {
    worst = std::max(worst,
                     std::abs(static_cast<double>(x) - median) / median * 100);
  }
  return worst;
}

int Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  TinyModelOptions model;
  model.shape = TinyShape::kSmall;
  CHECK(WriteTinyModel(model, model_dir).ok());
  const std::string log_path = model_dir + "/pdworker.log";
  const Worker worker =
      StartWorker(absl::GetFlag(FLAGS_pdworker), model_dir, log_path);
  const std::string target = absl::StrCat("127.0.0.1:", worker.port);
  auto status_stub = v1::Worker::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));

  Counters counters;
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  const int n = absl::GetFlag(FLAGS_clients);
  for (int i = 0; i < n; ++i) {
    // One connection per client, as separate routers would have.
    grpc::ChannelArguments args;
    args.SetInt("pdworker.soak.client", i);
    auto channel = grpc::CreateCustomChannel(
        target, grpc::InsecureChannelCredentials(), args);
    if (i % 2 == 0) {
      clients.emplace_back(ForwardClient, channel, i, std::cref(stop),
                           std::ref(counters));
    } else {
      clients.emplace_back(GenerateClient, channel, i, std::cref(stop),
                           std::ref(counters));
    }
  }

  const auto start = Clock::now();
  const auto end = start + std::chrono::minutes(absl::GetFlag(FLAGS_minutes));
  const auto period = std::chrono::seconds(absl::GetFlag(FLAGS_sample_seconds));
  std::vector<Sample> samples;
  std::printf(
      "| minute | RSS (MiB) | open fds | threads | KV blocks in use | live "
      "sequences | generations | tokens | errors |\n"
      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (auto next = start + period; next <= end; next += period) {
    std::this_thread::sleep_until(next);
    samples.push_back(TakeSample(worker.pid, *status_stub, start, counters));
    const Sample& s = samples.back();
    std::printf(
        "| %.1f | %.1f | %lld | %lld | %lld | %lld | %lld | %lld | %lld |\n",
        s.minutes, s.rss_kb / 1024.0, static_cast<long long>(s.fds),
        static_cast<long long>(s.threads),
        static_cast<long long>(s.kv_used_blocks),
        static_cast<long long>(s.sequences),
        static_cast<long long>(s.generations), static_cast<long long>(s.tokens),
        static_cast<long long>(s.errors));
    std::fflush(stdout);
  }
  stop = true;
  for (std::thread& t : clients) t.join();
  // Idle: everything given back.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const Sample idle = TakeSample(worker.pid, *status_stub, start, counters);

  kill(worker.pid, SIGTERM);
  int wstatus = 0;
  waitpid(worker.pid, &wstatus, 0);
  const int exit_code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;

  const size_t from = std::min<size_t>(
      samples.size(), static_cast<size_t>(absl::GetFlag(FLAGS_warmup_samples)));
  const double rss = Spread(samples, from, &Sample::rss_kb);
  const double fds = Spread(samples, from, &Sample::fds);
  const double threads = Spread(samples, from, &Sample::threads);
  const double kv = Spread(samples, from, &Sample::kv_used_blocks);
  std::printf(
      "\n%d clients (%d Forward-driven, %d Generate streams), %d min: %lld "
      "generations, %lld tokens, %lld errors. After warm-up (%zu samples "
      "left out), largest deviation from the median: RSS %.1f%%, open fds "
      "%.1f%%, threads %.1f%%, KV blocks in use %.1f%%. Idle after the load: "
      "%lld KV blocks in use, %lld live sequences, RSS %.1f MiB, %lld fds, "
      "%lld threads. Worker exit code on SIGTERM: %d.\n",
      n, (n + 1) / 2, n / 2, absl::GetFlag(FLAGS_minutes),
      static_cast<long long>(idle.generations),
      static_cast<long long>(idle.tokens), static_cast<long long>(idle.errors),
      from, rss, fds, threads, kv, static_cast<long long>(idle.kv_used_blocks),
      static_cast<long long>(idle.sequences), idle.rss_kb / 1024.0,
      static_cast<long long>(idle.fds), static_cast<long long>(idle.threads),
      exit_code);
  const bool flat = rss <= 5 && fds <= 5 && threads <= 5;
  return idle.errors == 0 && flat && idle.kv_used_blocks == 0 && exit_code == 0
             ? 0
             : 1;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  return pdworker::Run();
}
