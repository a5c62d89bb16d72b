// router: the reference router's command line. Sends prompts through
// prefill + decode workers (the P/D handoff) or through aggregated workers,
// streams the generated tokens, or runs the load mode.
//
//   router --prefill=127.0.0.1:50051 --decode=127.0.0.1:50052
//          --prompt='Hello|The quick brown fox' --max_tokens=16
//   router --aggregated=127.0.0.1:50051 --token_ids='1,2,3|4,5' --stats
//   router --prefill=... --decode=... --load_requests=200 --load_rate=50
//          --load_prompt_len=16-64
//   router --aggregated=127.0.0.1:50051,127.0.0.1:50052 --route_by_prefix
//          --kv_events_endpoints=127.0.0.1:50051=tcp://127.0.0.1:5557,...
//          --kv_events_replay_endpoints=127.0.0.1:50051=tcp://127.0.0.1:5558
//
// Prefix routing: each prompt goes to the worker (aggregated, or prefill)
// whose prefix cache holds the longest prefix of it, learned from the
// workers' KV events (start them with --kv_events_endpoint=tcp://*:PORT and
// --kv_events_replay_endpoint=tcp://*:PORT2); ties go to the least loaded.
//
// Several prompts: separate them with '|' in --prompt / --token_ids, or put
// one per line in --prompts_file. They run concurrently (so their decode
// steps batch); each gets one output line "<request id>: <tokens>", printed
// in order and streamed as the tokens arrive. Text goes through the byte
// tokenizer (one token per byte); output bytes outside printable ASCII are
// shown as \xNN. Exit status: 0 when every request succeeded, 1 when one
// failed (the error ends its line and is repeated on stderr), 2 for bad
// flags.
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tools/router/byte_tokenizer.h"
#include "tools/router/grpc_status.h"
#include "tools/router/load.h"
#include "tools/router/router.h"
#include "tools/router/stream_printer.h"

ABSL_FLAG(std::string, prefill, "",
          "Prefill workers (role prefill), host:port,... Needs --decode.");
ABSL_FLAG(std::string, decode, "",
          "Decode workers (role decode), host:port,... Needs --prefill.");
ABSL_FLAG(std::string, aggregated, "",
          "Aggregated workers (role both; no KV handoff), host:port,...");
ABSL_FLAG(std::string, prompt, "",
          "Text prompt(s), byte-tokenized; several separated by '|'.");
ABSL_FLAG(std::string, prompts_file, "",
          "A file with one text prompt per line (empty lines skipped).");
ABSL_FLAG(std::string, token_ids, "",
          "Prompt(s) as token ids: '1,2,3'; several separated by '|'.");
ABSL_FLAG(int, max_tokens, 16,
          "Tokens to generate per request (including the prefill's).");
ABSL_FLAG(int, eos_token_id, -1, "Stop at this token; -1: none.");
ABSL_FLAG(float, temperature, 0.0f, "0: greedy.");
ABSL_FLAG(int, top_k, 0, "0: off.");
ABSL_FLAG(float, top_p, 0.0f, "0 or 1: off.");
ABSL_FLAG(int64_t, seed, -1,
          "Sampling seed; -1: the workers derive one from the request id.");
ABSL_FLAG(std::string, request_id_prefix, "",
          "Request ids are <prefix>-<i>; default req-<pid>.");
ABSL_FLAG(std::string, output, "auto",
          "text | ids | auto (text for text prompts, ids for --token_ids).");
ABSL_FLAG(bool, timings, true,
          "After the outputs, print each request's TTFT split and ITL.");
ABSL_FLAG(int, load_requests, 0,
          "Load mode: this many requests with random prompts (0: off).");
ABSL_FLAG(double, load_rate, 20.0,
          "Load mode: Poisson arrivals per second; 0: all at once.");
ABSL_FLAG(std::string, load_prompt_len, "32",
          "Load mode: prompt length N, or a range MIN-MAX (uniform).");
ABSL_FLAG(int, load_vocab, 256, "Load mode: prompt ids in [0, load_vocab).");
ABSL_FLAG(uint64_t, load_seed, 1, "Load mode: seed of arrivals and prompts.");
ABSL_FLAG(bool, stats, false,
          "Afterwards print every worker's CUDA graph statistics table.");
ABSL_FLAG(bool, check, false,
          "Only wait for the workers (see --wait_s), print their status (and "
          "with --stats their tables) and exit.");
ABSL_FLAG(int, wait_s, 0,
          "Wait up to this many seconds for every worker to serve before "
          "starting (0: don't wait).");
ABSL_FLAG(int, timeout_s, 60, "Deadline of each prefill/import/decode RPC.");
ABSL_FLAG(bool, route_by_prefix, false,
          "Send each prompt to the worker whose KV cache holds its longest "
          "prefix (from the workers' KV events), ties to the least loaded.");
ABSL_FLAG(std::string, kv_events_endpoints, "",
          "With --route_by_prefix: worker=endpoint,... where worker is the "
          "address given in --aggregated/--prefill and endpoint its "
          "--kv_events_endpoint as the router reaches it "
          "(tcp://host:port).");
ABSL_FLAG(std::string, kv_events_replay_endpoints, "",
          "Optional, worker=endpoint,...: each worker's "
          "--kv_events_replay_endpoint, for missed batches and a router that "
          "starts after the workers.");
ABSL_FLAG(std::string, api, "step",
          "Which API drives the workers: step (pdworker.v1.Worker: the "
          "router schedules every decode step) or request "
          "(vllm.grpc.engine.VllmEngine only, as SMG drives vLLM workers: "
          "the workers own the decode loop).");

namespace pdworker::router {
namespace {

constexpr int kBadFlags = 2;
constexpr int kFailed = 1;

std::vector<std::string> SplitAddresses(const std::string& list) {
  return absl::StrSplit(list, ',', absl::SkipWhitespace());
}

struct Prompt {
  std::vector<int32_t> ids;
  std::string text;  // shown in the timing summary; empty for id prompts
};

absl::StatusOr<std::vector<Prompt>> ReadPrompts(bool* text_prompts) {
  std::vector<Prompt> prompts;
  *text_prompts = true;
  auto add_text = [&](absl::string_view text) {
    prompts.push_back(Prompt{ByteTokenizer::Encode(text), std::string{text}});
  };
  const std::string text = absl::GetFlag(FLAGS_prompt);
  if (!text.empty()) {
    for (absl::string_view p : absl::StrSplit(text, '|')) {
      if (!p.empty()) add_text(p);
    }
  }
  const std::string file = absl::GetFlag(FLAGS_prompts_file);
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompts_file: cannot read ", file));
    }
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty()) add_text(line);
    }
  }
  const std::string ids = absl::GetFlag(FLAGS_token_ids);
  if (!ids.empty()) {
    if (!prompts.empty()) {
      return absl::InvalidArgumentError(
          "--token_ids cannot be mixed with text prompts");
    }
    *text_prompts = false;
    for (absl::string_view group : absl::StrSplit(ids, '|')) {
      Prompt prompt;
      for (absl::string_view part :
           absl::StrSplit(group, ',', absl::SkipWhitespace())) {
        int32_t id;
        if (!absl::SimpleAtoi(part, &id)) {
          return absl::InvalidArgumentError(
              absl::StrCat("--token_ids: '", part, "' is not a token id"));
        }
        prompt.ids.push_back(id);
      }
      if (prompt.ids.empty()) {
        return absl::InvalidArgumentError("--token_ids: an empty prompt");
      }
      prompts.push_back(std::move(prompt));
    }
  }
  return prompts;
}

absl::StatusOr<std::pair<int, int>> ParseLengthRange(const std::string& s) {
  std::vector<std::string> parts = absl::StrSplit(s, '-');
  int lo = 0;
  int hi = 0;
  if (parts.size() == 1 && absl::SimpleAtoi(parts[0], &lo)) {
    hi = lo;
  } else if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &lo) ||
             !absl::SimpleAtoi(parts[1], &hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--load_prompt_len: want N or MIN-MAX, got '", s, "'"));
  }
  if (lo < 1 || hi < lo) {
    return absl::InvalidArgumentError(
        absl::StrCat("--load_prompt_len: need 1 <= MIN <= MAX, got '", s, "'"));
  }
  return std::make_pair(lo, hi);
}

Sampling SamplingFromFlags() {
  Sampling sampling;
  sampling.temperature = absl::GetFlag(FLAGS_temperature);
  sampling.top_k = absl::GetFlag(FLAGS_top_k);
  sampling.top_p = absl::GetFlag(FLAGS_top_p);
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    sampling.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  }
  return sampling;
}

std::optional<int32_t> EosFromFlags() {
  const int eos = absl::GetFlag(FLAGS_eos_token_id);
  if (eos < 0) return std::nullopt;
  return eos;
}

absl::StatusOr<v1::WorkerStatus> GetStatus(PoolWorker& worker) {
  grpc::ClientContext context;
  SetTimeout(&context, std::chrono::seconds(5));
  v1::WorkerStatus status;
  const grpc::Status s =
      worker.worker->GetStatus(&context, v1::GetStatusRequest(), &status);
  if (!s.ok()) return FromGrpc(s, "GetStatus", worker.address);
  return status;
}

// Polls every worker's GetStatus until all serve or `seconds` pass.
absl::Status WaitForWorkers(Router& router, int seconds) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  for (PoolWorker* worker : router.workers()) {
    while (true) {
      absl::StatusOr<v1::WorkerStatus> status = GetStatus(*worker);
      if (status.ok() && status->serving()) break;
      if (std::chrono::steady_clock::now() > give_up) {
        return absl::DeadlineExceededError(absl::StrCat(
            "worker ", worker->address, " is not serving after ", seconds,
            " s: ",
            status.ok() ? "serving=false" : status.status().ToString()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return absl::OkStatus();
}

void PrintWorkerStatus(Router& router) {
  for (PoolWorker* worker : router.workers()) {
    absl::StatusOr<v1::WorkerStatus> s = GetStatus(*worker);
    if (!s.ok()) {
      std::cout << worker->address << ": " << s.status() << "\n";
      continue;
    }
    std::cout << absl::StrFormat(
        "%-21s role %-7s mode %-18s kv blocks %d/%d free, %d sequences, "
        "%d leases%s\n",
        worker->address, s->role(), s->resolved_mode(), s->kv_blocks_free(),
        s->kv_blocks_total(), s->num_sequences(), s->kv_leases(),
        s->serving() ? "" : " (not serving)");
  }
}

absl::Status PrintGraphStats(Router& router) {
  for (PoolWorker* worker : router.workers()) {
    absl::StatusOr<v1::WorkerStatus> status = GetStatus(*worker);
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(10));
    v1::GraphStatsResponse stats;
    const grpc::Status s = worker->worker->GetGraphStats(
        &context, v1::GetGraphStatsRequest(), &stats);
    if (!s.ok()) return FromGrpc(s, "GetGraphStats", worker->address);
    std::cout << "\n== " << (status.ok() ? status->role() : "?") << " worker "
              << worker->address << "\n"
              << stats.table() << "\n";
  }
  return absl::OkStatus();
}

std::string Ms(int64_t micros) {
  return absl::StrFormat("%.2f ms", static_cast<double>(micros) / 1000.0);
}

int RunPrompts(Router& router, const std::vector<Prompt>& prompts, bool as_text,
               const std::string& prefix) {
  std::vector<std::string> ids;
  std::vector<std::string> line_prefixes;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(absl::StrCat(prefix, "-", i));
    line_prefixes.push_back(ids.back() + ": ");
  }
  StreamPrinter printer(std::cout, line_prefixes);
  std::vector<absl::StatusOr<GenerationResult>> results(
      prompts.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      GenerationRequest request;
      request.request_id = ids[i];
      request.prompt = prompts[i].ids;
      request.max_tokens = absl::GetFlag(FLAGS_max_tokens);
      request.eos_token_id = EosFromFlags();
      request.sampling = SamplingFromFlags();
      bool first = true;
      results[i] = router.Generate(request, [&](int32_t token) {
        printer.Append(
            i, as_text ? EscapeForTerminal(ByteTokenizer::DecodeOne(token))
                       : absl::StrCat(first ? "" : " ", token));
        first = false;
      });
      printer.Finish(
          i, results[i].ok()
                 ? ""
                 : absl::StrCat("  [error: ", results[i].status().ToString(),
                                "]"));
    });
  }
  for (std::thread& t : threads) t.join();

  int rc = 0;
  if (absl::GetFlag(FLAGS_timings)) std::cout << "\n";
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!results[i].ok()) {
      std::cerr << "router: " << ids[i] << " failed: " << results[i].status()
                << "\n";
      rc = kFailed;
      continue;
    }
    if (!absl::GetFlag(FLAGS_timings)) continue;
    const GenerationResult& r = *results[i];
    const GenerationTimings& t = r.timings;
    int64_t itl_sum = 0;
    for (const int64_t us : t.inter_token_us) itl_sum += us;
    std::cout << absl::StrFormat(
        "%s: %d prompt -> %d tokens (%s), TTFT %s (prefill %s on %s", ids[i],
        prompts[i].ids.size(), r.tokens.size(),
        r.finish_reason == FinishReason::kEos ? "eos" : "length", Ms(t.ttft_us),
        Ms(t.prefill_us), r.prefill_address);
    if (router.disaggregated() && !r.decode_address.empty()) {
      std::cout << absl::StrFormat(", transfer %s / %d bytes",
                                   Ms(t.transfer_us), t.transfer_bytes);
    }
    std::cout << ")";
    if (!t.inter_token_us.empty()) {
      std::cout << absl::StrFormat(
          ", first decode step %s, mean ITL %s on %s",
          Ms(t.first_decode_step_us),
          Ms(itl_sum / static_cast<int64_t>(t.inter_token_us.size())),
          r.decode_address);
    }
    std::cout << "\n";
  }
  const DecodeBatcherStats batching = router.decode_stats();
  if (absl::GetFlag(FLAGS_timings) && batching.iterations > 0) {
    std::cout << absl::StrFormat(
        "decode batching: %d iterations, %d Forward calls, %.2f sequences "
        "per call (max %d)\n",
        batching.iterations, batching.forward_calls,
        static_cast<double>(batching.sequence_steps) /
            static_cast<double>(batching.forward_calls),
        batching.max_sequences_per_call);
  }
  return rc;
}

int RunLoadMode(Router& router, const std::string& prefix) {
  absl::StatusOr<std::pair<int, int>> lengths =
      ParseLengthRange(absl::GetFlag(FLAGS_load_prompt_len));
  if (!lengths.ok()) {
    std::cerr << "router: " << lengths.status().message() << "\n";
    return kBadFlags;
  }
  LoadOptions options;
  options.num_requests = absl::GetFlag(FLAGS_load_requests);
  options.rate = absl::GetFlag(FLAGS_load_rate);
  options.prompt_len_min = lengths->first;
  options.prompt_len_max = lengths->second;
  options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.eos_token_id = EosFromFlags();
  options.vocab_size = absl::GetFlag(FLAGS_load_vocab);
  options.sampling = SamplingFromFlags();
  options.seed = absl::GetFlag(FLAGS_load_seed);
  options.request_id_prefix = prefix;
  absl::StatusOr<LoadReport> report = RunLoad(router, options);
  if (!report.ok()) {
    std::cerr << "router: " << report.status().message() << "\n";
    return kBadFlags;
  }
  std::cout << absl::StrFormat(
      "load: %d requests, %s arrivals, prompts %d..%d tokens, max_tokens %d, "
      "%s\n\n",
      options.num_requests,
      options.rate > 0 ? absl::StrFormat("Poisson %.1f/s", options.rate)
                       : std::string("simultaneous"),
      options.prompt_len_min, options.prompt_len_max, options.max_tokens,
      router.disaggregated() ? "prefill/decode" : "aggregated");
  std::cout << report->Format();
  return report->failed == 0 ? 0 : kFailed;
}

int Run() {
  RouterOptions options;
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api == "request") {
    options.api = RouterApi::kRequestLevel;
  } else if (api != "step") {
    std::cerr << "--api: '" << api << "' is not step or request\n";
    return 2;
  }
  options.prefill_addresses = SplitAddresses(absl::GetFlag(FLAGS_prefill));
  options.decode_addresses = SplitAddresses(absl::GetFlag(FLAGS_decode));
  options.aggregated_addresses =
      SplitAddresses(absl::GetFlag(FLAGS_aggregated));
  const std::chrono::milliseconds timeout(
      int64_t{1000} * std::max(1, absl::GetFlag(FLAGS_timeout_s)));
  options.prefill_timeout = timeout;
  options.import_timeout = timeout;
  options.decode_step_timeout = timeout;
  options.route_by_prefix = absl::GetFlag(FLAGS_route_by_prefix);
  for (const bool replay : {false, true}) {
    const std::string flag = absl::GetFlag(
        replay ? FLAGS_kv_events_replay_endpoints : FLAGS_kv_events_endpoints);
    if (absl::Status parsed =
            ParseKvEventEndpoints(flag, replay, &options.kv_events);
        !parsed.ok()) {
      std::cerr << "router: --kv_events" << (replay ? "_replay" : "")
                << "_endpoints: " << parsed.message() << "\n";
      return kBadFlags;
    }
  }
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Create(options);
  if (!router.ok()) {
    std::cerr << "router: " << router.status().message() << "\n";
    return kBadFlags;
  }
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "auto" && output != "text" && output != "ids") {
    std::cerr << "router: --output must be text, ids or auto\n";
    return kBadFlags;
  }
  std::string prefix = absl::GetFlag(FLAGS_request_id_prefix);
  if (prefix.empty()) prefix = absl::StrCat("req-", getpid());

  if (absl::GetFlag(FLAGS_wait_s) > 0) {
    if (absl::Status ready =
            WaitForWorkers(**router, absl::GetFlag(FLAGS_wait_s));
        !ready.ok()) {
      std::cerr << "router: " << ready.message() << "\n";
      return kFailed;
    }
  }
  if (absl::GetFlag(FLAGS_check)) {
    PrintWorkerStatus(**router);
    if (absl::GetFlag(FLAGS_stats)) {
      if (absl::Status printed = PrintGraphStats(**router); !printed.ok()) {
        std::cerr << "router: " << printed << "\n";
        return kFailed;
      }
    }
    return 0;
  }

  int rc = 0;
  if (absl::GetFlag(FLAGS_load_requests) > 0) {
    rc = RunLoadMode(**router, prefix);
  } else {
    bool text_prompts = true;
    absl::StatusOr<std::vector<Prompt>> prompts = ReadPrompts(&text_prompts);
    if (!prompts.ok()) {
      std::cerr << "router: " << prompts.status().message() << "\n";
      return kBadFlags;
    }
    if (prompts->empty()) {
      std::cerr << "router: no prompt: give --prompt, --prompts_file, "
                   "--token_ids or --load_requests\n";
      return kBadFlags;
    }
    const bool as_text = output == "text" || (output == "auto" && text_prompts);
    rc = RunPrompts(**router, *prompts, as_text, prefix);
  }
  if (absl::GetFlag(FLAGS_stats)) {
    if (absl::Status printed = PrintGraphStats(**router); !printed.ok()) {
      std::cerr << "router: " << printed << "\n";
      rc = kFailed;
    }
  }
  return rc;
}

}  // namespace
}  // namespace pdworker::router

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "The pdworker reference router: prompts through prefill + decode "
      "workers (or aggregated ones), streamed to stdout; or a load run.");
  absl::ParseCommandLine(argc, argv);
  return pdworker::router::Run();
}
