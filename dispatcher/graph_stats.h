// Per-step CUDA graph usage statistics: how often each (unpadded, padded,
// runtime mode) combination ran, rendered as the seeds' Markdown table and
// read by the Prometheus exporter.
#ifndef PDWORKER_DISPATCHER_GRAPH_STATS_H_
#define PDWORKER_DISPATCHER_GRAPH_STATS_H_

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "dispatcher/cudagraph_mode.h"

namespace pdworker {

// One aggregated row of the table.
struct GraphStatsRow {
  int unpadded_tokens = 0;
  int padded_tokens = 0;
  int num_paddings = 0;  // padded - unpadded
  RuntimeMode mode = RuntimeMode::kNone;
  int64_t count = 0;

  friend bool operator==(const GraphStatsRow& a, const GraphStatsRow& b) {
    return std::tie(a.unpadded_tokens, a.padded_tokens, a.num_paddings, a.mode,
                    a.count) == std::tie(b.unpadded_tokens, b.padded_tokens,
                                         b.num_paddings, b.mode, b.count);
  }
};

// What the table's header line shows.
struct GraphStatsHeader {
  CudaGraphMode mode;
  std::vector<int> capture_sizes;
};

// Thread-safe. Record() is called once per step by the engine; Snapshot()
// and RenderTable() by exporters and loggers on other threads. Counts live
// in kNumShards mutex-protected maps; each recording thread gets its own
// shard (round-robin slot), so one recorder pays one uncontended lock plus
// one hash probe, and concurrent recorders never share a lock. Measured on
// the 2-core dev VM (bench/RESULTS.md): ~49 ns per record single-threaded
// (a single shared mutex: ~46 ns), and with two recorders really running in
// parallel ~105 ns vs ~350 ns for the single mutex. Readers lock the shards
// one at a time and merge. Each map only grows when a new (unpadded, padded,
// mode) appears, bounded by max_num_batched_tokens per mode.
class GraphStats {
 public:
  GraphStats() = default;
  GraphStats(const GraphStats&) = delete;
  GraphStats& operator=(const GraphStats&) = delete;

  // Counts one step that had `unpadded` real tokens, ran with `padded`
  // tokens (== unpadded for eager steps) in runtime mode `mode`.
  void Record(int unpadded, int padded, RuntimeMode mode);

  // All rows, by count descending; equal counts ordered by (unpadded,
  // padded, mode) ascending so the output is deterministic.
  std::vector<GraphStatsRow> Snapshot() const;

  // Total number of recorded steps.
  int64_t TotalCount() const;

  // A header line with the mode and capture sizes, then the Markdown table
  //   | Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |
  // with a separator row and one row per Snapshot() entry, cells
  // left-aligned and padded to the column width.
  std::string RenderTable(const GraphStatsHeader& header) const;

 private:
  struct Key {
    int unpadded;
    int padded;
    RuntimeMode mode;

    friend bool operator==(const Key& a, const Key& b) {
      return a.unpadded == b.unpadded && a.padded == b.padded &&
             a.mode == b.mode;
    }
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.unpadded, k.padded, k.mode);
    }
  };

  static constexpr int kNumShards = 16;
  // Own cache line per shard so recorders on different shards do not
  // false-share the mutex words.
  struct alignas(64) Shard {
    mutable std::mutex mu;
    absl::flat_hash_map<Key, int64_t> counts ABSL_GUARDED_BY(mu);
  };

  Shard& ShardForThisThread();

  std::array<Shard, kNumShards> shards_;
};

// Renders `rows` (in the given order) under `header`; exposed so callers can
// render a filtered or merged snapshot.
std::string RenderGraphStatsTable(const GraphStatsHeader& header,
                                  const std::vector<GraphStatsRow>& rows);

}  // namespace pdworker

#endif  // PDWORKER_DISPATCHER_GRAPH_STATS_H_
