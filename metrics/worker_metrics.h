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
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "dispatcher/cudagraph_dispatcher.h"
#include "dispatcher/cudagraph_mode.h"
#include "dispatcher/graph_stats.h"
#include "dispatcher/step_info.h"
#include "metrics/composite_registry.h"
#include "metrics/graph_stats_collector.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/runtime/capture_session.h"

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

struct WorkerMetricsOptions {
  // Cap on exported statistics-table label sets (see GraphStatsCollector).
  int max_table_rows = kDefaultMaxTableRows;
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
  kSourceUnavailable,  // the source could not be reached, died or stalled
  kDeadline,           // the caller's (ImportKv) deadline passed
  kLeaseNotFound,      // unknown or expired lease
  kAlreadyPulled,      // the lease was pulled (or is being pulled) already
  kModelMismatch,      // another model's fingerprint or KV layout
  kMalformedStream,    // chunks out of order, wrong sizes, stream cut short
  kCancelled,          // send side: the puller went away mid-stream
  kHandleMismatch,     // the handle's num_tokens is not its lease's
  kInternal,           // anything else (a device copy failed, ...)
};
inline constexpr int kNumKvTransferOutcomes = 10;
// "ok", "source_unavailable", "deadline", "lease_not_found",
// "already_pulled", "model_mismatch", "malformed_stream", "cancelled",
// "handle_mismatch", "internal".
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
