// Test data for the KV event publishers: batches of events shaped like a
// prefix cache's (chained stores, removals of stored blocks, clears), from a
// seed, and the plan a consumer checks them against.
#ifndef PDWORKER_TESTS_KV_EVENTS_KV_EVENT_TEST_UTIL_H_
#define PDWORKER_TESTS_KV_EVENTS_KV_EVENT_TEST_UTIL_H_

#include <cstdint>
#include <vector>

#include "nlohmann/json.hpp"
#include "worker/kv_cache/kv_cache_events.h"

namespace pdworker::kv_events_testing {

using Batch = std::vector<KvCacheEvent>;

// `num_batches` batches (some empty): stores of 1..4 blocks of `block_size`
// tokens under full 64-bit hashes (about half above 2^63), chained to a
// stored block or starting a sequence, removals of stored blocks, and an
// occasional clear.
std::vector<Batch> RandomBatches(int num_batches, uint64_t seed,
                                 int32_t block_size = 16);

// {"type", "block_hashes", "parent_block_hash" (null when none),
// "token_ids", "block_size"} as the plan lists an event.
nlohmann::json EventJson(const KvCacheEvent& event);

}  // namespace pdworker::kv_events_testing

#endif  // PDWORKER_TESTS_KV_EVENTS_KV_EVENT_TEST_UTIL_H_
