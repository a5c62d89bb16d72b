#include "tests/kv_events/kv_event_test_util.h"

#include <random>
#include <type_traits>
#include <variant>

namespace pdworker::kv_events_testing {

std::vector<Batch> RandomBatches(int num_batches, uint64_t seed,
                                 int32_t block_size) {
  std::mt19937_64 rng(seed);
  std::vector<ExternalBlockHash> stored;
  std::vector<Batch> batches(num_batches);
  for (int b = 0; b < num_batches; ++b) {
    const int num_events = b % 7 == 6 ? 0 : 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < num_events; ++e) {
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 6 || stored.empty()) {
        BlockStoredEvent s;
        s.block_size = block_size;
        const int blocks = 1 + static_cast<int>(rng() % 4);
        if (!stored.empty() && rng() % 3 != 0) {
          s.parent_block_hash = stored[rng() % stored.size()];
        }
        for (int i = 0; i < blocks; ++i) {
          s.block_hashes.push_back(rng());
          for (int t = 0; t < block_size; ++t) {
            s.token_ids.push_back(static_cast<int32_t>(rng() % 152000));
          }
        }
        stored.insert(stored.end(), s.block_hashes.begin(),
                      s.block_hashes.end());
        batches[b].push_back(std::move(s));
      } else if (kind < 9) {
        BlockRemovedEvent r;
        const int n = 1 + static_cast<int>(rng() % 3);
        for (int i = 0; i < n && !stored.empty(); ++i) {
          const size_t at = rng() % stored.size();
          r.block_hashes.push_back(stored[at]);
          stored.erase(stored.begin() + at);
        }
        batches[b].push_back(std::move(r));
      } else {
        stored.clear();
        batches[b].push_back(AllBlocksClearedEvent{});
      }
    }
  }
  return batches;
}

nlohmann::json EventJson(const KvCacheEvent& event) {
  nlohmann::json j;
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, BlockStoredEvent>) {
          j["type"] = "BlockStored";
          j["block_hashes"] = e.block_hashes;
          j["parent_block_hash"] = e.parent_block_hash.has_value()
                                       ? nlohmann::json(*e.parent_block_hash)
                                       : nlohmann::json(nullptr);
          j["token_ids"] = e.token_ids;
          j["block_size"] = e.block_size;
        } else if constexpr (std::is_same_v<T, BlockRemovedEvent>) {
          j["type"] = "BlockRemoved";
          j["block_hashes"] = e.block_hashes;
        } else {
          j["type"] = "AllBlocksCleared";
        }
      },
      event);
  return j;
}

}  // namespace pdworker::kv_events_testing
