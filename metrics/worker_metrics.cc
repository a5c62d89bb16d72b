#include "metrics/worker_metrics.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "prometheus/family.h"

namespace pdworker {
namespace {

using prometheus::Histogram;

// Step latency: 100 us (a small decode graph replay) to 10 s (a long eager
// prefill on the CPU backend), 1-2.5-5 per decade.
Histogram::BucketBoundaries StepBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
}

// RPCs and KV transfers can also wait in a queue or on the network: the
// step buckets plus 30 s and 60 s.
Histogram::BucketBoundaries RequestBuckets() {
  Histogram::BucketBoundaries buckets = StepBuckets();
  buckets.push_back(30);
  buckets.push_back(60);
  return buckets;
}

Histogram::BucketBoundaries PowersOfTwo(int max) {
  Histogram::BucketBoundaries buckets;
  for (int b = 1; b <= max; b *= 2) buckets.push_back(b);
  return buckets;
}

constexpr std::array<absl::string_view, 17> kStatusCodeNames = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

int StatusCodeIndex(absl::StatusCode code) {
  const int index = static_cast<int>(code);
  return index >= 0 && index < static_cast<int>(kStatusCodeNames.size())
             ? index
             : static_cast<int>(absl::StatusCode::kUnknown);
}

int ModeIndex(RuntimeMode mode) {
  const int index = static_cast<int>(mode);
  return index >= 0 && index < kNumRuntimeModes ? index : 0;
}

std::string Str(absl::string_view s) { return {s.data(), s.size()}; }

}  // namespace

absl::string_view KvTransportName(KvTransport transport) {
  switch (transport) {
    case KvTransport::kGrpc:
      return "grpc";
    case KvTransport::kCudaIpc:
      return "cuda_ipc";
    case KvTransport::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::string_view KvTransferDirectionName(KvTransferDirection direction) {
  switch (direction) {
    case KvTransferDirection::kReceive:
      return "receive";
    case KvTransferDirection::kSend:
      return "send";
  }
  return "unknown";
}

absl::string_view KvTransferOutcomeName(KvTransferOutcome outcome) {
  switch (outcome) {
    case KvTransferOutcome::kOk:
      return "ok";
    case KvTransferOutcome::kSourceUnreachable:
      return "source_unreachable";
    case KvTransferOutcome::kTransportError:
      return "transport_error";
    case KvTransferOutcome::kDeadline:
      return "deadline";
    case KvTransferOutcome::kLeaseExpired:
      return "lease_expired";
    case KvTransferOutcome::kLeaseNotFound:
      return "lease_not_found";
    case KvTransferOutcome::kAlreadyPulled:
      return "already_pulled";
    case KvTransferOutcome::kModelMismatch:
      return "model_mismatch";
    case KvTransferOutcome::kMalformedStream:
      return "malformed_stream";
    case KvTransferOutcome::kCancelled:
      return "cancelled";
    case KvTransferOutcome::kHandleMismatch:
      return "handle_mismatch";
    case KvTransferOutcome::kInternal:
      return "internal";
  }
  return "internal";
}

absl::string_view StatusCodeLabel(absl::StatusCode code) {
  return kStatusCodeNames[StatusCodeIndex(code)];
}

WorkerMetrics::WorkerMetrics(const WorkerInfo& info,
                             const GraphStats* graph_stats,
                             const GraphStatsHeader& table_header)
    : WorkerMetrics(info, graph_stats, table_header, WorkerMetricsOptions()) {}

WorkerMetrics::WorkerMetrics(const WorkerInfo& info,
                             const GraphStats* graph_stats,
                             const GraphStatsHeader& table_header,
                             const WorkerMetricsOptions& options)
    : registry_(std::make_shared<CompositeRegistry>()),
      table_(std::make_shared<GraphStatsCollector>(graph_stats, table_header,
                                                   options.max_table_rows)) {
  prometheus::Registry& r = *registry_;

  prometheus::BuildGauge()
      .Name("pdworker_worker_info")
      .Help("Worker identity; the value is always 1.")
      .Register(r)
      .Add({{"role", info.role},
            {"configured_mode", info.configured_mode},
            {"resolved_mode", info.resolved_mode},
            {"model", info.model},
            {"model_fingerprint", info.model_fingerprint},
            {"device", info.device}})
      .Set(1);

  // --- Steps ---
  auto& fallbacks =
      prometheus::BuildCounter()
          .Name("pdworker_cudagraph_fallbacks_total")
          .Help(
              "Steps that ran eagerly although CUDA graphs were possible "
              "or configured, by fallback reason.")
          .Register(r);
  for (int i = 0; i < kNumFallbackReasons; ++i) {
    const auto reason = static_cast<FallbackReason>(i);
    if (reason == FallbackReason::kNone) continue;  // not a fallback
    fallbacks_[i] =
        &fallbacks.Add({{"reason", Str(FallbackReasonName(reason))}});
  }

  auto& step_duration =
      prometheus::BuildHistogram()
          .Name("pdworker_step_duration_seconds")
          .Help(
              "Model step duration (inputs, forward, sampling), by "
              "runtime mode.")
          .Register(r);
  for (int i = 0; i < kNumRuntimeModes; ++i) {
    step_duration_[i] = &step_duration.Add(
        {{"mode", Str(RuntimeModeName(static_cast<RuntimeMode>(i)))}},
        StepBuckets());
  }
  step_tokens_ = &prometheus::BuildHistogram()
                      .Name("pdworker_step_tokens")
                      .Help("Real (unpadded) tokens per model step.")
                      .Register(r)
                      .Add({}, PowersOfTwo(8192));
  step_sequences_ = &prometheus::BuildHistogram()
                         .Name("pdworker_step_sequences")
                         .Help("Sequences per model step (coalesced batch).")
                         .Register(r)
                         .Add({}, PowersOfTwo(1024));
  step_calls_ = &prometheus::BuildHistogram()
                     .Name("pdworker_step_calls")
                     .Help("Forward calls coalesced into one model step.")
                     .Register(r)
                     .Add({}, PowersOfTwo(1024));

  // --- Forward RPCs ---
  auto& forward_requests = prometheus::BuildCounter()
                               .Name("pdworker_forward_requests_total")
                               .Help("Forward RPCs by final gRPC status code.")
                               .Register(r);
  for (size_t i = 0; i < kStatusCodeNames.size(); ++i) {
    forward_requests_[i] =
        &forward_requests.Add({{"code", Str(kStatusCodeNames[i])}});
  }
  forward_duration_ =
      &prometheus::BuildHistogram()
           .Name("pdworker_forward_request_duration_seconds")
           .Help(
               "Forward RPC duration, receipt to completion, all status "
               "codes.")
           .Register(r)
           .Add({}, RequestBuckets());
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("pdworker_executor_queue_depth")
                      .Help("Forward calls waiting in the engine queue.")
                      .Register(r)
                      .Add({});

  // --- KV cache ---
  auto& kv_blocks = prometheus::BuildGauge()
                        .Name("pdworker_kv_cache_blocks")
                        .Help("KV cache blocks by state.")
                        .Register(r);
  kv_used_blocks_ = &kv_blocks.Add({{"state", "used"}});
  kv_free_blocks_ = &kv_blocks.Add({{"state", "free"}});
  kv_usage_ratio_ = &prometheus::BuildGauge()
                         .Name("pdworker_kv_cache_usage_ratio")
                         .Help("Used KV cache blocks / all blocks (0 to 1).")
                         .Register(r)
                         .Add({});
  prefix_queries_ =
      &prometheus::BuildCounter()
           .Name("pdworker_prefix_cache_queries_total")
           .Help(
               "Prompt tokens of new sequences looked up in the prefix cache "
               "(vLLM's prefix_cache_queries).")
           .Register(r)
           .Add({});
  prefix_hits_ = &prometheus::BuildCounter()
                      .Name("pdworker_prefix_cache_hits_total")
                      .Help(
                          "Of the looked-up tokens, those found cached and "
                          "not computed (vLLM's prefix_cache_hits).")
                      .Register(r)
                      .Add({});
  prefix_evictions_ =
      &prometheus::BuildCounter()
           .Name("pdworker_prefix_cache_evictions_total")
           .Help("Cached KV blocks no sequence held, reused for new tokens.")
           .Register(r)
           .Add({});
  prefix_cached_blocks_ =
      &prometheus::BuildGauge()
           .Name("pdworker_prefix_cache_blocks")
           .Help(
               "KV blocks in the prefix cache (held by sequences or free "
               "until evicted).")
           .Register(r)
           .Add({});

  // --- Graph capture ---
  auto& graphs = prometheus::BuildGauge()
                     .Name("pdworker_cudagraph_graphs")
                     .Help("CUDA graph keys captured, by runtime mode.")
                     .Register(r);
  auto& capture_seconds =
      prometheus::BuildGauge()
          .Name("pdworker_cudagraph_capture_seconds")
          .Help(
              "Time the last capture of this mode's graphs took, warmups "
              "included.")
          .Register(r);
  auto& capture_memory =
      prometheus::BuildGauge()
          .Name("pdworker_cudagraph_capture_memory_bytes")
          .Help(
              "Device memory in use after minus before capturing this "
              "mode's graphs (may be negative).")
          .Register(r);
  for (RuntimeMode mode : {RuntimeMode::kPiecewise, RuntimeMode::kFull}) {
    const int i = static_cast<int>(mode);
    const prometheus::Labels labels = {{"mode", Str(RuntimeModeName(mode))}};
    graphs_[i] = &graphs.Add(labels);
    capture_seconds_[i] = &capture_seconds.Add(labels);
    capture_memory_bytes_[i] = &capture_memory.Add(labels);
  }
  graph_objects_ =
      &prometheus::BuildGauge()
           .Name("pdworker_cudagraph_graph_objects")
           .Help(
               "Device graph objects held: one per FULL key, one per "
               "piece per PIECEWISE key.")
           .Register(r)
           .Add({});

  // --- KV handoff ---
  auto& transfers = prometheus::BuildCounter()
                        .Name("pdworker_kv_transfers_total")
                        .Help("KV transfer attempts (successful or not).")
                        .Register(r);
  auto& failures = prometheus::BuildCounter()
                       .Name("pdworker_kv_transfer_failures_total")
                       .Help("KV transfer attempts that failed, by reason.")
                       .Register(r);
  auto& bytes = prometheus::BuildCounter()
                    .Name("pdworker_kv_transfer_bytes_total")
                    .Help("KV cache bytes moved by transfers.")
                    .Register(r);
  auto& transfer_duration = prometheus::BuildHistogram()
                                .Name("pdworker_kv_transfer_duration_seconds")
                                .Help("KV transfer duration, all outcomes.")
                                .Register(r);
  for (int t = 0; t < kNumKvTransports; ++t) {
    for (int d = 0; d < kNumKvTransferDirections; ++d) {
      const prometheus::Labels labels = {
          {"transport", Str(KvTransportName(static_cast<KvTransport>(t)))},
          {"direction",
           Str(KvTransferDirectionName(static_cast<KvTransferDirection>(d)))}};
      kv_transfers_[t][d] = &transfers.Add(labels);
      for (int o = 1; o < kNumKvTransferOutcomes; ++o) {
        prometheus::Labels with_reason = labels;
        with_reason["reason"] =
            Str(KvTransferOutcomeName(static_cast<KvTransferOutcome>(o)));
        kv_transfer_failures_[t][d][o] = &failures.Add(with_reason);
      }
      kv_transfer_bytes_[t][d] = &bytes.Add(labels);
      kv_transfer_duration_[t][d] =
          &transfer_duration.Add(labels, RequestBuckets());
    }
  }
  kv_lease_expiries_ =
      &prometheus::BuildCounter()
           .Name("pdworker_kv_lease_expiries_total")
           .Help(
               "KV leases that expired before the decode side released "
               "them (their blocks were freed).")
           .Register(r)
           .Add({});
  kv_leases_ = &prometheus::BuildGauge()
                    .Name("pdworker_kv_leases")
                    .Help("KV leases currently held for a decode worker.")
                    .Register(r)
                    .Add({});
  sequences_expired_ =
      &prometheus::BuildCounter()
           .Name("pdworker_sequences_expired_total")
           .Help(
               "Live sequences released because no step or Release came "
               "for them within --sequence_idle_timeout (their router "
               "abandoned them; their KV blocks were freed).")
           .Register(r)
           .Add({});

  RegisterRequestFamilies(options);
  RegisterSpecDecodeFamilies(options);
  registry_->AddCollectable(table_);
}

WorkerMetrics::~WorkerMetrics() {
  // The registry may outlive us (an exposer holds it); GraphStats may not.
  table_->Detach();
}

void WorkerMetrics::ObserveStep(const StepInfo& step) {
  const int reason_index = static_cast<int>(step.fallback_reason);
  if (reason_index > 0 && reason_index < kNumFallbackReasons) {
    fallbacks_[reason_index]->Increment();
  }
  step_duration_[ModeIndex(step.mode)]->Observe(step.device_seconds);
  step_tokens_->Observe(step.unpadded_tokens);
  step_sequences_->Observe(step.num_sequences);
  step_calls_->Observe(step.num_calls);
}

void WorkerMetrics::ObserveForwardCall(absl::StatusCode code, double seconds) {
  forward_requests_[StatusCodeIndex(code)]->Increment();
  forward_duration_->Observe(seconds);
}

void WorkerMetrics::SetKvBlocks(int64_t used, int64_t free) {
  kv_used_blocks_->Set(static_cast<double>(used));
  kv_free_blocks_->Set(static_cast<double>(free));
  const int64_t total = used + free;
  kv_usage_ratio_->Set(total > 0 ? static_cast<double>(used) / total : 0.0);
}

void WorkerMetrics::SetPrefixCache(int64_t query_tokens, int64_t hit_tokens,
                                   int64_t evictions, int64_t cached_blocks) {
  const auto advance = [](prometheus::Counter* counter, int64_t total,
                          int64_t* seen) {
    if (total > *seen) counter->Increment(static_cast<double>(total - *seen));
    *seen = std::max(*seen, total);
  };
  advance(prefix_queries_, query_tokens, &prefix_queries_seen_);
  advance(prefix_hits_, hit_tokens, &prefix_hits_seen_);
  advance(prefix_evictions_, evictions, &prefix_evictions_seen_);
  prefix_cached_blocks_->Set(static_cast<double>(cached_blocks));
}

void WorkerMetrics::SetQueueDepth(int64_t depth) {
  queue_depth_->Set(static_cast<double>(depth));
}

void WorkerMetrics::SetCaptureSummary(const CaptureSummary& summary,
                                      int graphs_captured) {
  std::array<double, kNumRuntimeModes> graphs{};
  std::array<double, kNumRuntimeModes> seconds{};
  std::array<double, kNumRuntimeModes> memory{};
  for (const ModeCaptureSummary& mode : summary.modes) {
    const int i = ModeIndex(mode.mode);
    graphs[i] += mode.num_graphs;
    seconds[i] += mode.seconds;
    memory[i] += static_cast<double>(mode.memory_delta_bytes);
  }
  for (int i = 0; i < kNumRuntimeModes; ++i) {
    if (graphs_[i] == nullptr) continue;  // NONE: nothing to capture
    graphs_[i]->Set(graphs[i]);
    capture_seconds_[i]->Set(seconds[i]);
    capture_memory_bytes_[i]->Set(memory[i]);
  }
  graph_objects_->Set(graphs_captured);
}

void WorkerMetrics::ObserveKvTransfer(KvTransport transport,
                                      KvTransferDirection direction,
                                      KvTransferOutcome outcome, int64_t bytes,
                                      double seconds) {
  const int t = static_cast<int>(transport);
  const int d = static_cast<int>(direction);
  const int o = static_cast<int>(outcome);
  if (t < 0 || t >= kNumKvTransports || d < 0 ||
      d >= kNumKvTransferDirections || o < 0 || o >= kNumKvTransferOutcomes) {
    return;
  }
  kv_transfers_[t][d]->Increment();
  if (outcome != KvTransferOutcome::kOk) {
    kv_transfer_failures_[t][d][o]->Increment();
  }
  if (bytes > 0)
    kv_transfer_bytes_[t][d]->Increment(static_cast<double>(bytes));
  kv_transfer_duration_[t][d]->Observe(seconds);
}

void WorkerMetrics::IncrementKvLeaseExpiries() {
  kv_lease_expiries_->Increment();
}

void WorkerMetrics::IncrementSequencesExpired() {
  sequences_expired_->Increment();
}

void WorkerMetrics::SetKvLeases(int64_t active) {
  kv_leases_->Set(static_cast<double>(active));
}

}  // namespace pdworker
