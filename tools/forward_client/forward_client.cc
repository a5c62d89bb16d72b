// forward_client: a small pdworker client for demos and manual checks. Sends
// a prompt (as token ids), then greedy or sampled decode steps, printing each
// step's tokens, runtime mode and padding, and finally the worker's CUDA
// graph statistics table.
//
//   forward_client --target=127.0.0.1:50051 --prompt=1,2,3,4,5 --steps=8
//   forward_client --prompt=7,8,9 --num_sequences=3   # one call, 3 sequences
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "proto/worker.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Worker address.");
ABSL_FLAG(std::string, prompt, "1,2,3,4,5",
          "Prompt token ids, comma-separated.");
ABSL_FLAG(int, steps, 8, "Decode steps after the prompt.");
ABSL_FLAG(int, num_sequences, 1,
          "Sequences per call (the same prompt, ids <sequence_id>-<i>).");
ABSL_FLAG(std::string, sequence_id, "", "Id prefix; default demo-<pid>.");
ABSL_FLAG(float, temperature, 0.0f, "0 = greedy.");
ABSL_FLAG(bool, release, true,
          "Free the sequences' KV cache with the last step.");
ABSL_FLAG(bool, stats, true, "Print GetGraphStats' table at the end.");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA to verify a TLS worker.");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS).");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mutual TLS).");

namespace pdworker {
namespace {

std::string ReadFile(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

const char* ModeName(v1::RuntimeMode mode) {
  switch (mode) {
    case v1::RUNTIME_MODE_NONE:
      return "NONE";
    case v1::RUNTIME_MODE_PIECEWISE:
      return "PIECEWISE";
    case v1::RUNTIME_MODE_FULL:
      return "FULL";
    default:
      return "?";
  }
}

int Run() {
  std::vector<int32_t> prompt;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_prompt), ',', absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      std::cerr << "--prompt: '" << part << "' is not a token id\n";
      return 2;
    }
    prompt.push_back(id);
  }
  const int n = absl::GetFlag(FLAGS_num_sequences);
  if (prompt.empty() || n < 1) {
    std::cerr << "--prompt needs a token and --num_sequences >= 1\n";
    return 2;
  }
  std::string prefix = absl::GetFlag(FLAGS_sequence_id);
  if (prefix.empty()) prefix = absl::StrCat("demo-", getpid());

  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ReadFile(absl::GetFlag(FLAGS_tls_ca));
    tls.pem_cert_chain = ReadFile(absl::GetFlag(FLAGS_tls_cert));
    tls.pem_private_key = ReadFile(absl::GetFlag(FLAGS_tls_key));
    credentials = grpc::SslCredentials(tls);
  }
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), credentials));

  std::vector<std::vector<int32_t>> tokens(n);
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step <= steps; ++step) {
    v1::ForwardRequest request;
    for (int i = 0; i < n; ++i) {
      v1::SequenceInput* s = request.add_sequences();
      s->set_sequence_id(n == 1 ? prefix : absl::StrCat(prefix, "-", i));
      if (step == 0) {
        for (const int32_t t : prompt) s->add_token_ids(t);
        s->set_start(true);
      } else {
        s->add_token_ids(tokens[i].back());
      }
      s->mutable_sampling()->set_temperature(absl::GetFlag(FLAGS_temperature));
      s->set_release_after_step(step == steps && absl::GetFlag(FLAGS_release));
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(60));
    v1::ForwardResponse response;
    const grpc::Status status = stub->Forward(&context, request, &response);
    if (!status.ok()) {
      std::cerr << "Forward failed: " << status.error_code() << " "
                << status.error_message() << "\n";
      return 1;
    }
    std::vector<std::string> sampled;
    for (int i = 0; i < n; ++i) {
      tokens[i].push_back(response.sequences(i).token_id());
      sampled.push_back(absl::StrCat(response.sequences(i).token_id()));
    }
    const v1::StepInfo& info = response.step();
    std::printf(
        "step %2d %-7s -> %-14s mode %-9s padded %3d -> %-3d seqs %d%s%s  "
        "%lld us\n",
        step, step == 0 ? "prompt" : "decode",
        absl::StrJoin(sampled, ",").c_str(), ModeName(info.runtime_mode()),
        info.unpadded_tokens(), info.padded_tokens(), info.num_sequences(),
        info.fallback_reason().empty()
            ? ""
            : absl::StrCat(" (eager: ", info.fallback_reason(), ")").c_str(),
        response.num_steps() > 1
            ? absl::StrCat(" [", response.num_steps(), " chunks]").c_str()
            : "",
        static_cast<long long>(info.step_micros()));
  }
  for (int i = 0; i < n; ++i) {
    std::printf("tokens[%d]: %s\n", i, absl::StrJoin(tokens[i], " ").c_str());
  }

  if (absl::GetFlag(FLAGS_stats)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    v1::GraphStatsResponse stats;
    const grpc::Status status =
        stub->GetGraphStats(&context, v1::GetGraphStatsRequest(), &stats);
    if (!status.ok()) {
      std::cerr << "GetGraphStats failed: " << status.error_message() << "\n";
      return 1;
    }
    std::printf("\n%s\n", stats.table().c_str());
  }
  return 0;
}

}  // namespace
}  // namespace pdworker

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Sends a prompt and decode steps to a pdworker and prints what ran.");
  absl::ParseCommandLine(argc, argv);
  return pdworker::Run();
}
