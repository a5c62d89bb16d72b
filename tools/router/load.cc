#include "tools/router/load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdworker::router {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status ValidateLoadOptions(const LoadOptions& o) {
  if (o.num_requests < 1) {
    return absl::InvalidArgumentError("load: num_requests must be >= 1");
  }
  if (o.prompt_len_min < 1 || o.prompt_len_max < o.prompt_len_min) {
    return absl::InvalidArgumentError(
        absl::StrCat("load: prompt lengths need 1 <= min <= max, got ",
                     o.prompt_len_min, "..", o.prompt_len_max));
  }
  if (o.max_tokens < 1) {
    return absl::InvalidArgumentError("load: max_tokens must be >= 1");
  }
  if (o.vocab_size < 1) {
    return absl::InvalidArgumentError("load: vocab_size must be >= 1");
  }
  if (o.max_concurrency < 1) {
    return absl::InvalidArgumentError("load: max_concurrency must be >= 1");
  }
  if (!std::isfinite(o.rate)) {
    return absl::InvalidArgumentError("load: rate must be finite");
  }
  return absl::OkStatus();
}

std::string Row(const char* name, const LatencySummary& s) {
  if (s.count == 0) return absl::StrFormat("%-24s %9s\n", name, "-");
  return absl::StrFormat("%-24s %9.3f %9.3f %9.3f %8d\n", name, s.mean_ms,
                         s.p50_ms, s.p99_ms, s.count);
}

}  // namespace

LoadPlan MakeLoadPlan(const LoadOptions& options) {
  LoadPlan plan;
  std::mt19937_64 rng(options.seed);
  std::exponential_distribution<double> gap(options.rate > 0 ? options.rate
                                                             : 1.0);
  std::uniform_int_distribution<int> length(options.prompt_len_min,
                                            options.prompt_len_max);
  std::uniform_int_distribution<int32_t> token(0, options.vocab_size - 1);
  double t = 0;
  for (int i = 0; i < options.num_requests; ++i) {
    // The first request arrives at 0, so the run starts with work.
    if (i > 0 && options.rate > 0) t += gap(rng);
    plan.arrival_seconds.push_back(t);
    GenerationRequest request;
    request.request_id = absl::StrCat(options.request_id_prefix, "-", i);
    const int n = length(rng);
    for (int k = 0; k < n; ++k) request.prompt.push_back(token(rng));
    request.max_tokens = options.max_tokens;
    request.eos_token_id = options.eos_token_id;
    request.sampling = options.sampling;
    plan.requests.push_back(std::move(request));
  }
  return plan;
}

LatencySummary Summarize(std::vector<int64_t> micros) {
  LatencySummary s;
  if (micros.empty()) return s;
  std::sort(micros.begin(), micros.end());
  s.count = static_cast<int64_t>(micros.size());
  double sum = 0;
  for (const int64_t m : micros) sum += static_cast<double>(m);
  s.mean_ms = sum / static_cast<double>(s.count) / 1000.0;
  auto rank = [&](double q) {
    // Nearest rank: the smallest sample with at least q of them at or below.
    const auto k =
        static_cast<size_t>(std::ceil(q * static_cast<double>(micros.size())));
    return static_cast<double>(micros[std::max<size_t>(k, 1) - 1]) / 1000.0;
  };
  s.p50_ms = rank(0.50);
  s.p99_ms = rank(0.99);
  return s;
}

std::string LoadReport::Format() const {
  std::string out;
  absl::StrAppendFormat(&out, "requests        %d (ok %d, failed %d)\n",
                        requests, succeeded, failed);
  if (late_starts > 0) {
    absl::StrAppendFormat(
        &out, "late starts     %d (concurrency cap reached)\n", late_starts);
  }
  absl::StrAppendFormat(&out, "wall time       %.3f s\n", wall_seconds);
  absl::StrAppendFormat(&out, "output tokens   %d (%.1f tokens/s)\n",
                        output_tokens, output_tokens_per_second);
  out += "\n";
  absl::StrAppendFormat(&out, "%-24s %9s %9s %9s %8s\n", "latency (ms)", "mean",
                        "p50", "p99", "n");
  // TTFT is the prefill's token; the next three rows split the time to the
  // first DECODED token (P/D: what disaggregation adds before streaming).
  out += Row("TTFT", ttft);
  out += Row("prefill Forward", prefill);
  out += Row("KV transfer (ImportKv)", transfer);
  out += Row("first decode step", first_decode_step);
  out += Row("inter-token", inter_token);
  for (const std::string& e : first_errors) {
    absl::StrAppend(&out, "error: ", e, "\n");
  }
  return out;
}

absl::StatusOr<LoadReport> RunLoad(Router& router, const LoadOptions& options) {
  if (absl::Status valid = ValidateLoadOptions(options); !valid.ok()) {
    return valid;
  }
  const LoadPlan plan = MakeLoadPlan(options);
  const int n = static_cast<int>(plan.requests.size());

  std::mutex mu;  // guards the fields below and `report`
  LoadReport report;
  report.requests = n;
  std::vector<int64_t> ttft, inter_token, prefill, transfer, first_decode;
  Clock::time_point last_done;

  // A fixed set of threads takes requests in arrival order, each waiting for
  // its request's arrival time.
  std::atomic<int> next{0};
  const Clock::time_point start = Clock::now();
  auto run = [&] {
    while (true) {
      const int i = next.fetch_add(1);
      if (i >= n) return;
      const auto arrival =
          start + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(plan.arrival_seconds[i]));
      std::this_thread::sleep_until(arrival);
      const bool late = Clock::now() - arrival > std::chrono::milliseconds(10);
      absl::StatusOr<GenerationResult> result =
          router.Generate(plan.requests[i]);
      std::lock_guard<std::mutex> lock(mu);
      last_done = std::max(last_done, Clock::now());
      if (late) ++report.late_starts;
      if (!result.ok()) {
        ++report.failed;
        if (report.first_errors.size() < 5) {
          report.first_errors.push_back(absl::StrCat(
              plan.requests[i].request_id, ": ", result.status().ToString()));
        }
        continue;
      }
      ++report.succeeded;
      report.output_tokens += static_cast<int64_t>(result->tokens.size());
      const GenerationTimings& t = result->timings;
      ttft.push_back(t.ttft_us);
      prefill.push_back(t.prefill_us);
      // Only requests that reached the stage: a P/D request that ended with
      // its first token never transferred.
      if (t.transfer_us > 0) transfer.push_back(t.transfer_us);
      if (t.first_decode_step_us > 0) {
        first_decode.push_back(t.first_decode_step_us);
      }
      inter_token.insert(inter_token.end(), t.inter_token_us.begin(),
                         t.inter_token_us.end());
    }
  };
  std::vector<std::thread> threads;
  const int num_threads = std::min(n, options.max_concurrency);
  threads.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads.emplace_back(run);
  for (std::thread& t : threads) t.join();

  report.wall_seconds =
      std::chrono::duration<double>(last_done - start).count();
  if (report.wall_seconds > 0) {
    report.output_tokens_per_second =
        static_cast<double>(report.output_tokens) / report.wall_seconds;
  }
  report.ttft = Summarize(std::move(ttft));
  report.inter_token = Summarize(std::move(inter_token));
  report.prefill = Summarize(std::move(prefill));
  report.transfer = Summarize(std::move(transfer));
  report.first_decode_step = Summarize(std::move(first_decode));
  return report;
}

}  // namespace pdworker::router
