// WorkerMetrics, part 2: engine-owned requests (latency histograms, token
// and finish counters) and the load gauges routers and autoscalers read.
// metrics/README.md ("Requests", "Load") defines each per role.
#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "metrics/worker_metrics.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"

namespace pdworker {
namespace {

using prometheus::Histogram;
using Clock = RequestTimeline::Clock;

// Request latencies (TTFT, end to end, queue, prefill, decode): 1 ms (a
// tiny model's prefill on the CPU backend, a cached prompt on a GPU) to
// 640 s (a long generation under load); 1-2.5-5 per decade to 10 s, then
// doubling.
Histogram::BucketBoundaries RequestLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
          2.5,   5,      10,    20,   40,    80,   160, 320,  640};
}

// Inter-token latency: 0.5 ms (a small decode graph replay) to 10 s (a
// request stalled behind long prefills); dense where decode steps live on
// a GPU (5 to 50 ms).
Histogram::BucketBoundaries InterTokenBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02,
          0.025,  0.03,  0.04,   0.05,  0.075,  0.1,  0.15,  0.2,
          0.3,    0.5,   1,      2.5,   5,      10};
}

bool Reached(Clock::time_point t) { return t != Clock::time_point{}; }

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::max(0.0, std::chrono::duration<double>(to - from).count());
}

}  // namespace

absl::string_view RequestEndName(RequestEnd end) {
  switch (end) {
    case RequestEnd::kStop:
      return "stop";
    case RequestEnd::kLength:
      return "length";
    case RequestEnd::kAbort:
      return "abort";
    case RequestEnd::kError:
      return "error";
  }
  return "error";
}

void WorkerMetrics::RegisterRequestFamilies(
    const WorkerMetricsOptions& options) {
  prometheus::Registry& r = *registry_;
  auto histogram = [&r](const std::string& name, const std::string& help,
                        const Histogram::BucketBoundaries& buckets) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add(
        {}, buckets);
  };
  auto counter = [&r](const std::string& name, const std::string& help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add(
        {});
  };
  auto gauge = [&r](const std::string& name, const std::string& help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };

  // --- Engine-owned requests ---
  time_to_first_token_ = histogram(
      "pdworker_request_time_to_first_token_seconds",
      "Engine-owned requests: arrival to first output token (a decode leg: "
      "arrival to its first streamed token, KV import included).",
      RequestLatencyBuckets());
  inter_token_latency_ = histogram(
      "pdworker_request_inter_token_latency_seconds",
      "Engine-owned requests: time between consecutive token updates of a "
      "request (one sample per step that gave it tokens).",
      InterTokenBuckets());
  e2e_latency_ =
      histogram("pdworker_request_e2e_latency_seconds",
                "Engine-owned requests: arrival to end, every finish reason.",
                RequestLatencyBuckets());
  queue_time_ = histogram(
      "pdworker_request_queue_time_seconds",
      "Engine-owned requests: arrival to first scheduled (a decode leg: "
      "arrival to its KV imported and the request running).",
      RequestLatencyBuckets());
  prefill_time_ = histogram(
      "pdworker_request_prefill_time_seconds",
      "Engine-owned requests: first scheduled to first output token (0 for "
      "a decode leg, whose first token came from the prefill worker).",
      RequestLatencyBuckets());
  decode_time_ = histogram(
      "pdworker_request_decode_time_seconds",
      "Engine-owned requests that produced a token: first to last output "
      "token.",
      RequestLatencyBuckets());
  prompt_tokens_ = counter(
      "pdworker_prompt_tokens_total",
      "Prompt tokens of engine-owned requests prefilled here (cached ones "
      "included; a decode leg's imported prompt is not).");
  generation_tokens_ =
      counter("pdworker_generation_tokens_total",
              "Output tokens streamed by engine-owned requests.");
  auto& finished = prometheus::BuildCounter()
                       .Name("pdworker_requests_finished_total")
                       .Help("Engine-owned requests that ended, by reason.")
                       .Register(r);
  for (int i = 0; i < kNumRequestEnds; ++i) {
    requests_finished_[i] = &finished.Add(
        {{"reason", std::string(RequestEndName(static_cast<RequestEnd>(i)))}});
  }
  preemptions_ = counter(
      "pdworker_request_preemptions_total",
      "Running engine-owned requests preempted (recomputed later) for lack "
      "of KV blocks.");

  // --- Load ---
  requests_running_ =
      gauge("pdworker_requests_running",
            "Engine-owned requests in the running batch (prefilling or "
            "decoding).");
  requests_waiting_ =
      gauge("pdworker_requests_waiting",
            "Engine-owned requests submitted or preempted and not running.");
  kv_imports_waiting_ =
      gauge("pdworker_kv_imports_waiting",
            "KV imports (ImportKv, P/D decode legs) waiting for room in a "
            "full KV cache or for a running seat.");
  step_level_sequences_ =
      gauge("pdworker_step_level_sequences",
            "Step-level (Forward) sequences holding KV on this worker.");
  waiting_prompt_tokens_ = gauge(
      "pdworker_waiting_prompt_tokens",
      "Prompt tokens accepted and not yet computed: waiting requests, the "
      "unprefilled rest of running ones, queued Forward calls' tokens.");
  kv_used_tokens_ = gauge("pdworker_kv_cache_used_tokens",
                          "Tokens whose K/V live sequences hold.");
  kv_capacity_tokens_ =
      gauge("pdworker_kv_cache_capacity_tokens",
            "Tokens the KV cache can hold: blocks times tokens per block.");
  kv_capacity_tokens_->Set(static_cast<double>(
      int64_t{options.cache.num_blocks} * options.cache.block_size));
  prometheus::BuildGauge()
      .Name("pdworker_cache_config_info")
      .Help(
          "KV cache configuration (vLLM's cache_config_info); the value is "
          "always 1.")
      .Register(r)
      .Add({{"block_size", absl::StrCat(options.cache.block_size)},
            {"num_gpu_blocks", absl::StrCat(options.cache.num_blocks)},
            {"kv_cache_bytes", absl::StrCat(options.cache.kv_cache_bytes)},
            {"enable_prefix_caching",
             options.cache.prefix_caching ? "True" : "False"}})
      .Set(1);

  if (options.vllm_aliases == VllmAliases::kOn) {
    // vLLM's names and labels (model_name, engine "0"), from the same values
    // as ours: llm-d's and GIE's endpoint picker read the first three and
    // cache_config_info's block_size/num_gpu_blocks; production-stack's
    // router reads gpu_cache_usage_perc (vLLM's older name). A `:` is legal
    // in a metric name but reserved for recording rules, so `promtool check
    // metrics` lints the worker without these (README).
    const prometheus::Labels labels = {
        {"model_name", options.served_model_name}, {"engine", "0"}};
    auto alias = [&r, &labels](const std::string& name,
                               const std::string& help) {
      return &prometheus::BuildGauge()
                  .Name(name)
                  .Help(help + " (--metrics_vllm_aliases)")
                  .Register(r)
                  .Add(labels);
    };
    vllm_running_ = alias("vllm:num_requests_running",
                          "pdworker_requests_running + "
                          "pdworker_step_level_sequences");
    vllm_waiting_ = alias("vllm:num_requests_waiting",
                          "pdworker_requests_waiting + "
                          "pdworker_executor_queue_depth");
    vllm_kv_usage_ = alias("vllm:kv_cache_usage_perc",
                           "KV-cache usage, 0 to 1: "
                           "pdworker_kv_cache_usage_ratio");
    vllm_gpu_kv_usage_ = alias("vllm:gpu_cache_usage_perc",
                               "KV-cache usage, 0 to 1: "
                               "pdworker_kv_cache_usage_ratio");
    prometheus::BuildGauge()
        .Name("vllm:cache_config_info")
        .Help("pdworker_cache_config_info (--metrics_vllm_aliases)")
        .Register(r)
        .Add({{"block_size", absl::StrCat(options.cache.block_size)},
              {"num_gpu_blocks", absl::StrCat(options.cache.num_blocks)},
              {"enable_prefix_caching",
               options.cache.prefix_caching ? "True" : "False"},
              {"engine", "0"}})
        .Set(1);
  }
}

void WorkerMetrics::ObserveFirstToken(const RequestTimeline& timeline,
                                      int32_t prefilled_tokens,
                                      int32_t num_tokens) {
  time_to_first_token_->Observe(
      Seconds(timeline.arrival, timeline.first_token));
  const Clock::time_point scheduled =
      Reached(timeline.scheduled) ? timeline.scheduled : timeline.first_token;
  queue_time_->Observe(Seconds(timeline.arrival, scheduled));
  prefill_time_->Observe(Seconds(scheduled, timeline.first_token));
  if (prefilled_tokens > 0) prompt_tokens_->Increment(prefilled_tokens);
  if (num_tokens > 0) generation_tokens_->Increment(num_tokens);
}

void WorkerMetrics::ObserveNextTokens(double seconds_since_previous,
                                      int32_t num_tokens) {
  inter_token_latency_->Observe(std::max(0.0, seconds_since_previous));
  if (num_tokens > 0) generation_tokens_->Increment(num_tokens);
}

void WorkerMetrics::ObserveRequestEnd(const RequestTimeline& timeline,
                                      RequestEnd end, Clock::time_point now) {
  e2e_latency_->Observe(Seconds(timeline.arrival, now));
  if (Reached(timeline.first_token)) {
    decode_time_->Observe(Seconds(timeline.first_token, timeline.last_token));
  }
  const int i = static_cast<int>(end);
  requests_finished_[i >= 0 && i < kNumRequestEnds ? i : kNumRequestEnds - 1]
      ->Increment();
}

void WorkerMetrics::SetEngineLoad(const EngineLoad& load) {
  SetKvBlocks(load.used_blocks, load.free_blocks);
  SetQueueDepth(load.queued_calls);
  requests_running_->Set(static_cast<double>(load.running_requests));
  requests_waiting_->Set(static_cast<double>(load.waiting_requests));
  kv_imports_waiting_->Set(static_cast<double>(load.kv_imports_waiting));
  step_level_sequences_->Set(static_cast<double>(load.step_level_sequences));
  waiting_prompt_tokens_->Set(static_cast<double>(load.waiting_prompt_tokens));
  kv_used_tokens_->Set(static_cast<double>(load.used_tokens));
  if (load.preemptions > preemptions_seen_) {
    preemptions_->Increment(
        static_cast<double>(load.preemptions - preemptions_seen_));
    preemptions_seen_ = load.preemptions;
  }
  if (vllm_running_ != nullptr) {
    vllm_running_->Set(
        static_cast<double>(load.running_requests + load.step_level_sequences));
    // vLLM counts a request waiting for its remote KV as waiting too.
    vllm_waiting_->Set(static_cast<double>(
        load.waiting_requests + load.queued_calls + load.kv_imports_waiting));
    const int64_t total = load.used_blocks + load.free_blocks;
    const double usage =
        total > 0 ? static_cast<double>(load.used_blocks) / total : 0.0;
    vllm_kv_usage_->Set(usage);
    vllm_gpu_kv_usage_->Set(usage);
  }
}

}  // namespace pdworker
