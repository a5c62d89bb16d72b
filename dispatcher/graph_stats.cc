#include "dispatcher/graph_stats.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdworker {

GraphStats::Shard& GraphStats::ShardForThisThread() {
  // Threads take slots round-robin on first use, so up to kNumShards
  // concurrent recorders never share a lock (hashing thread ids collided:
  // pthread ids are recycled stack addresses). The slot is a process-wide,
  // per-thread constant, not state of any GraphStats.
  static std::atomic<uint32_t> next_slot{0};
  thread_local const uint32_t slot =
      next_slot.fetch_add(1, std::memory_order_relaxed);
  return shards_[slot % kNumShards];
}

void GraphStats::Record(int unpadded, int padded, RuntimeMode mode) {
  Shard& shard = ShardForThisThread();
  std::lock_guard<std::mutex> lock(shard.mu);
  ++shard.counts[Key{unpadded, padded, mode}];
}

std::vector<GraphStatsRow> GraphStats::Snapshot() const {
  absl::flat_hash_map<Key, int64_t> merged;
  for (const Shard& shard : shards_) {
    std::lock_guard<std::mutex> lock(shard.mu);
    for (const auto& [key, count] : shard.counts) merged[key] += count;
  }
  std::vector<GraphStatsRow> rows;
  rows.reserve(merged.size());
  for (const auto& [key, count] : merged) {
    rows.push_back(GraphStatsRow{key.unpadded, key.padded,
                                 key.padded - key.unpadded, key.mode, count});
  }
  std::sort(rows.begin(), rows.end(),
            [](const GraphStatsRow& a, const GraphStatsRow& b) {
              if (a.count != b.count) return a.count > b.count;
              return std::tie(a.unpadded_tokens, a.padded_tokens, a.mode) <
                     std::tie(b.unpadded_tokens, b.padded_tokens, b.mode);
            });
  return rows;
}

int64_t GraphStats::TotalCount() const {
  int64_t total = 0;
  for (const Shard& shard : shards_) {
    std::lock_guard<std::mutex> lock(shard.mu);
    for (const auto& entry : shard.counts) total += entry.second;
  }
  return total;
}

std::string GraphStats::RenderTable(const GraphStatsHeader& header) const {
  return RenderGraphStatsTable(header, Snapshot());
}

std::string RenderGraphStatsTable(const GraphStatsHeader& header,
                                  const std::vector<GraphStatsRow>& rows) {
  constexpr int kColumns = 5;
  const std::array<std::string, kColumns> titles = {
      "Unpadded Tokens", "Padded Tokens", "Num Paddings", "Runtime Mode",
      "Count"};
  std::vector<std::array<std::string, kColumns>> cells;
  cells.reserve(rows.size());
  for (const GraphStatsRow& row : rows) {
    cells.push_back(
        {absl::StrCat(row.unpadded_tokens), absl::StrCat(row.padded_tokens),
         absl::StrCat(row.num_paddings), std::string(RuntimeModeName(row.mode)),
         absl::StrCat(row.count)});
  }
  std::array<size_t, kColumns> widths;
  for (int c = 0; c < kColumns; ++c) {
    widths[c] = titles[c].size();
    for (const auto& line : cells)
      widths[c] = std::max(widths[c], line[c].size());
  }
  auto render_line = [&](const std::array<std::string, kColumns>& line) {
    std::string out = "|";
    for (int c = 0; c < kColumns; ++c) {
      absl::StrAppend(&out, " ", line[c],
                      std::string(widths[c] - line[c].size(), ' '), " |");
    }
    out += "\n";
    return out;
  };

  std::string out = absl::StrCat(
      "CUDA graph stats (mode: ", header.mode.ToString(), ", capture sizes: [",
      absl::StrJoin(header.capture_sizes, ", "), "])\n");
  out += render_line(titles);
  out += "|";
  for (int c = 0; c < kColumns; ++c) {
    absl::StrAppend(&out, std::string(widths[c] + 2, '-'), "|");
  }
  out += "\n";
  for (const auto& line : cells) out += render_line(line);
  return out;
}

}  // namespace pdworker
