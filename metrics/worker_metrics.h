// WorkerMetrics: every Prometheus metric a pdworker process exports, in one
// registry (metrics/README.md lists them with types, labels and units).
//
// Two kinds of families live in registry():
//  - prometheus-cpp counters/gauges/histograms updated by the Observe*/Set*
//    calls below (step latency, fallbacks, Forward calls, KV, capture, ...);
//  - the CUDA graph statistics table, read from GraphStats at scrape time by
//    a GraphStatsCollector (so the table and Prometheus never disagree).
// Every label set with a known, bounded value space is created up front, so
// dashboards see zeros instead of missing series.
//
// Thread safety: everything may be called concurrently (ObserveStep from the
// engine thread, the rest from gRPC threads, Collect() from exposer
// threads). prometheus-cpp metrics are thread-safe; WorkerMetrics holds no
// other mutable state.
#ifndef PDWORKER_METRICS_WORKER_METRICS_H_
#define PDWORKER_METRICS_WORKER_METRICS_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "dispatcher/capture_summary.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "dispatcher/step_info.h"
#include "metrics/composite_registry.h"
#include "metrics/graph_stats_collector.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace pdworker {

// Labels of pdworker_worker_info. Values are free-form; empty ones are
// dropped by Prometheus (an empty label equals an absent one).
struct WorkerInfo {
  std::string role;             // "prefill", "decode", "both"
  std::string configured_mode;  // e.g. "FULL_AND_PIECEWISE"
  std::string resolved_mode;    // after attention-backend resolution
  std::string model;
  std::string model_fingerprint;
  std::string device;
};

// The KV cache's configuration, exported as pdworker_cache_config_info
// (vLLM's cache_config_info).
struct CacheConfigInfo {
  int32_t block_size = 0;  // tokens per block
  int32_t num_blocks = 0;
  int64_t kv_cache_bytes = 0;  // all layers, K and V
  bool prefix_caching = false;
};

// Whether the few vLLM-named load gauges (vllm:num_requests_running,
// vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_
// perc, vllm:cache_config_info) are exported beside ours, for the endpoint
// pickers, routers and autoscaler examples that query those names.
enum class VllmAliases { kOff, kOn };

struct WorkerMetricsOptions {
  // Cap on exported statistics-table label sets (see GraphStatsCollector).
  int max_table_rows = kDefaultMaxTableRows;
  VllmAliases vllm_aliases = VllmAliases::kOff;
  // The aliases' model_name label (vLLM's served model name).
  std::string served_model_name;
  CacheConfigInfo cache;
};

// An engine-owned request's milestones (steady clock; epoch: not reached).
struct RequestTimeline {
  using Clock = std::chrono::steady_clock;
  // Its RPC arrived (before a decode leg's KV import).
  Clock::time_point arrival{};
  // It first entered a running batch (a decode leg: once its KV was here).
  Clock::time_point scheduled{};
  // Its first output token was read back (a decode leg: the prefill
  // worker's token, emitted when the request starts).
  Clock::time_point first_token{};
  Clock::time_point last_token{};  // its latest output token was read back
};

// How an engine-owned request ended (the `reason` label of
// pdworker_requests_finished_total): vLLM's finish reasons, plus errors.
enum class RequestEnd : uint8_t {
  kStop,    // EOS or a stop token id
  kLength,  // max_tokens or the length limit
  kAbort,   // Abort, client cancellation, deadline
  kError,   // a device error, the worker stopping, an internal error
};
inline constexpr int kNumRequestEnds = 4;
// "stop", "length", "abort", "error".
absl::string_view RequestEndName(RequestEnd end);

// What the engine holds and owes, for the load gauges (set after every
// engine loop iteration).
struct EngineLoad {
  int64_t running_requests = 0;  // engine-owned, in the running batch
  int64_t waiting_requests = 0;  // submitted or preempted, not running
  // KV imports (ImportKv, P/D decode legs) waiting for room in a full KV
  // cache or for a running seat (--kv_import_wait_timeout).
  int64_t kv_imports_waiting = 0;
  // Step-level (Forward) sequences holding KV.
  int64_t step_level_sequences = 0;
  // Forward and Release calls queued or running.
  int64_t queued_calls = 0;
  // Prompt tokens accepted and not computed yet: waiting requests' prompts
  // (a preempted one's prompt and outputs), running requests' unprefilled
  // rest, queued Forward calls' unrun tokens.
  int64_t waiting_prompt_tokens = 0;
  int64_t used_blocks = 0;
  int64_t free_blocks = 0;
  int64_t used_tokens = 0;  // tokens held by live sequences
  int64_t preemptions = 0;  // since start (a counter's total)
};

// KV handoff (DESIGN "P/D KV handoff"): how the bytes travelled, and which
// side of the transfer this worker was. Fixed enums keep labels bounded.
enum class KvTransport : uint8_t { kGrpc, kCudaIpc, kNccl };
inline constexpr int kNumKvTransports = 3;
// "grpc", "cuda_ipc", "nccl".
absl::string_view KvTransportName(KvTransport transport);

enum class KvTransferDirection : uint8_t {
  kReceive,  // decode side: pulled KV from a prefill worker
  kSend,     // prefill side: served a pull
};
inline constexpr int kNumKvTransferDirections = 2;
// "receive", "send".
absl::string_view KvTransferDirectionName(KvTransferDirection direction);

// How a KV transfer attempt ended; every value but kOk is a failure reason
// (the `reason` label of pdworker_kv_transfer_failures_total).
enum class KvTransferOutcome : uint8_t {
  kOk,
  // Receive side: nothing came from the source (refused, unresolvable, or
  // silent until --kv_pull_timeout): the prefill worker is down or cut off.
  kSourceUnreachable,
  // Receive side: the transfer started and then broke (the source died or
  // stalled mid-stream, the NCCL receive failed).
  kTransportError,
  kDeadline,         // the caller's (ImportKv) deadline passed
  kLeaseExpired,     // the lease's TTL passed before the pull
  kLeaseNotFound,    // unknown lease (never issued, released, long gone)
  kAlreadyPulled,    // the lease was pulled (or is being pulled) already
  kModelMismatch,    // another model's fingerprint or KV layout
  kMalformedStream,  // chunks out of order, wrong sizes, stream cut short
  kCancelled,        // send side: the puller went away mid-stream
  kHandleMismatch,   // the handle's num_tokens is not its lease's
  kInternal,         // anything else (a device copy failed, ...)
};
inline constexpr int kNumKvTransferOutcomes = 12;
// "ok", "source_unreachable", "transport_error", "deadline",
// "lease_expired", "lease_not_found", "already_pulled", "model_mismatch",
// "malformed_stream", "cancelled", "handle_mismatch", "internal".
absl::string_view KvTransferOutcomeName(KvTransferOutcome outcome);

// gRPC code name ("OK", "INVALID_ARGUMENT", ...); "UNKNOWN" for values
// outside the 17 canonical codes.
absl::string_view StatusCodeLabel(absl::StatusCode code);

class WorkerMetrics {
 public:
  // `graph_stats` may be null (no table yet); otherwise it must outlive this
  // object. registry() may outlive it: the table families then disappear
  // from scrapes (the series go stale).
  WorkerMetrics(const WorkerInfo& info, const GraphStats* graph_stats,
                const GraphStatsHeader& table_header);
  WorkerMetrics(const WorkerInfo& info, const GraphStats* graph_stats,
                const GraphStatsHeader& table_header,
                const WorkerMetricsOptions& options);
  ~WorkerMetrics();

  WorkerMetrics(const WorkerMetrics&) = delete;
  WorkerMetrics& operator=(const WorkerMetrics&) = delete;

  // Everything, table included. Hand it to MetricsServer::Start.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One executed step. The table row itself is recorded by the model runner
  // into GraphStats; this adds what the table does not have: the fallback
  // reason (counted when != kNone), the step duration by mode, and the
  // coalesced batch size (tokens, sequences, Forward calls merged).
  void ObserveStep(const StepInfo& step);

  // Every Forward RPC, by its final status, with its end-to-end duration.
  void ObserveForwardCall(absl::StatusCode code, double seconds);

  // KV cache blocks; also sets the usage ratio used / (used + free).
  void SetKvBlocks(int64_t used, int64_t free);

  // Forward calls waiting in the engine queue.
  void SetQueueDepth(int64_t depth);

  // --- Engine-owned requests (request_metrics.cc) ---

  // A request's first `num_tokens` output tokens (usually 1): time to first
  // token, queue time, prefill time, the token counters (`prefilled_tokens`:
  // its prompt, 0 when imported).
  void ObserveFirstToken(const RequestTimeline& timeline,
                         int32_t prefilled_tokens, int32_t num_tokens);
  // `num_tokens` more output tokens, read `seconds_since_previous` after the
  // request's previous ones (one inter-token latency sample per update).
  void ObserveNextTokens(double seconds_since_previous, int32_t num_tokens);
  // A request ended `now`: end-to-end latency, decode time (first to last
  // token), and the finished counter by reason.
  void ObserveRequestEnd(const RequestTimeline& timeline, RequestEnd end,
                         RequestTimeline::Clock::time_point now);
  // The load gauges (and the preemption counter, advanced by the difference
  // to the previous call: one caller, the engine thread). Also sets the KV
  // block gauges and the queue depth.
  void SetEngineLoad(const EngineLoad& load);

  // The prefix cache's totals since start (KvCacheStats: tokens looked up
  // and found, blocks evicted) and the blocks cached now. The counters
  // advance by the difference to the previous call: one caller (the engine
  // thread).
  void SetPrefixCache(int64_t query_tokens, int64_t hit_tokens,
                      int64_t evictions, int64_t cached_blocks);

  // What CaptureGraphs() reported (graphs, seconds and memory per mode;
  // modes absent from `summary` are set to 0) and `graphs_captured`, the
  // device graph objects now held (ModelRunner::NumCapturedGraphs(): FULL
  // graphs plus every PIECEWISE piece's). Call again after a recapture.
  void SetCaptureSummary(const CaptureSummary& summary, int graphs_captured);

  // --- Speculative decoding (spec_decode_metrics.cc) ---

  // One verify step of a request with `num_draft_tokens` drafts, of which
  // the first `num_accepted_tokens` were accepted. One caller (the engine
  // thread).
  void ObserveSpeculation(int32_t num_draft_tokens,
                          int32_t num_accepted_tokens);

  // --- KV handoff (issue 8) ---

  // One finished KV transfer attempt: how it ended, the `bytes` actually
  // moved (also for failures) and its duration.
  void ObserveKvTransfer(KvTransport transport, KvTransferDirection direction,
                         KvTransferOutcome outcome, int64_t bytes,
                         double seconds);
  // A prefill-side lease expired before the decode side released it.
  void IncrementKvLeaseExpiries();
  // Leases currently held (prefill side).
  void SetKvLeases(int64_t active);
  // A live sequence was released because no step came for it within
  // --sequence_idle_timeout (its router abandoned it).
  void IncrementSequencesExpired();

 private:
  static constexpr int kNumStatusCodes = 17;  // OK .. UNAUTHENTICATED

  std::shared_ptr<CompositeRegistry> registry_;
  std::shared_ptr<GraphStatsCollector> table_;

  // Pointers into families owned by registry_ (stable for its lifetime).
  std::array<prometheus::Counter*, kNumFallbackReasons> fallbacks_{};
  std::array<prometheus::Histogram*, kNumRuntimeModes> step_duration_{};
  prometheus::Histogram* step_tokens_ = nullptr;
  prometheus::Histogram* step_sequences_ = nullptr;
  prometheus::Histogram* step_calls_ = nullptr;
  std::array<prometheus::Counter*, kNumStatusCodes> forward_requests_{};
  prometheus::Histogram* forward_duration_ = nullptr;
  prometheus::Gauge* kv_used_blocks_ = nullptr;
  prometheus::Gauge* kv_free_blocks_ = nullptr;
  prometheus::Gauge* kv_usage_ratio_ = nullptr;
  prometheus::Counter* prefix_queries_ = nullptr;
  prometheus::Counter* prefix_hits_ = nullptr;
  prometheus::Counter* prefix_evictions_ = nullptr;
  prometheus::Gauge* prefix_cached_blocks_ = nullptr;
  int64_t prefix_queries_seen_ = 0, prefix_hits_seen_ = 0,
          prefix_evictions_seen_ = 0;
  prometheus::Gauge* queue_depth_ = nullptr;
  // Speculative decoding (spec_decode_metrics.cc): our counter and its
  // vLLM alias (null without --metrics_vllm_aliases), and the per-position
  // counters, made as positions are first drafted.
  struct SpecCounters {
    prometheus::Counter* ours = nullptr;
    prometheus::Counter* vllm = nullptr;
  };
  struct SpecDecode {
    SpecCounters drafts, draft_tokens, accepted_tokens;
    prometheus::Family<prometheus::Counter>* per_position = nullptr;
    prometheus::Family<prometheus::Counter>* vllm_per_position = nullptr;
    prometheus::Labels vllm_labels;
    std::vector<prometheus::Counter*> position, vllm_position;
  };
  void RegisterSpecDecodeFamilies(const WorkerMetricsOptions& options);
  SpecDecode spec_decode_;
  // Requests and load (request_metrics.cc).
  void RegisterRequestFamilies(const WorkerMetricsOptions& options);
  prometheus::Histogram* time_to_first_token_ = nullptr;
  prometheus::Histogram* inter_token_latency_ = nullptr;
  prometheus::Histogram* e2e_latency_ = nullptr;
  prometheus::Histogram* queue_time_ = nullptr;
  prometheus::Histogram* prefill_time_ = nullptr;
  prometheus::Histogram* decode_time_ = nullptr;
  prometheus::Counter* prompt_tokens_ = nullptr;
  prometheus::Counter* generation_tokens_ = nullptr;
  std::array<prometheus::Counter*, kNumRequestEnds> requests_finished_{};
  prometheus::Counter* preemptions_ = nullptr;
  int64_t preemptions_seen_ = 0;
  prometheus::Gauge* requests_running_ = nullptr;
  prometheus::Gauge* requests_waiting_ = nullptr;
  prometheus::Gauge* kv_imports_waiting_ = nullptr;
  prometheus::Gauge* step_level_sequences_ = nullptr;
  prometheus::Gauge* waiting_prompt_tokens_ = nullptr;
  prometheus::Gauge* kv_used_tokens_ = nullptr;
  prometheus::Gauge* kv_capacity_tokens_ = nullptr;
  // --metrics_vllm_aliases (null without).
  prometheus::Gauge* vllm_running_ = nullptr;
  prometheus::Gauge* vllm_waiting_ = nullptr;
  prometheus::Gauge* vllm_kv_usage_ = nullptr;
  prometheus::Gauge* vllm_gpu_kv_usage_ = nullptr;
  // Indexed by RuntimeMode; the kNone entries stay null (nothing captured).
  std::array<prometheus::Gauge*, kNumRuntimeModes> graphs_{};
  std::array<prometheus::Gauge*, kNumRuntimeModes> capture_seconds_{};
  std::array<prometheus::Gauge*, kNumRuntimeModes> capture_memory_bytes_{};
  prometheus::Gauge* graph_objects_ = nullptr;
  // [transport][direction].
  std::array<std::array<prometheus::Counter*, kNumKvTransferDirections>,
             kNumKvTransports>
      kv_transfers_{};
  // [transport][direction][outcome]; the kOk entries stay null.
  std::array<
      std::array<std::array<prometheus::Counter*, kNumKvTransferOutcomes>,
                 kNumKvTransferDirections>,
      kNumKvTransports>
      kv_transfer_failures_{};
  std::array<std::array<prometheus::Counter*, kNumKvTransferDirections>,
             kNumKvTransports>
      kv_transfer_bytes_{};
  std::array<std::array<prometheus::Histogram*, kNumKvTransferDirections>,
             kNumKvTransports>
      kv_transfer_duration_{};
  prometheus::Counter* kv_lease_expiries_ = nullptr;
  prometheus::Gauge* kv_leases_ = nullptr;
  prometheus::Counter* sequences_expired_ = nullptr;
};

}  // namespace pdworker

#endif  // PDWORKER_METRICS_WORKER_METRICS_H_
