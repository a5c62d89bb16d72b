// KV cache events as vLLM's msgpack `KVEventBatch`: the payload (third
// frame) of every ZMQ message KvEventPublisher sends, and of every replayed
// batch. Only msgpack-cxx writes the bytes; this file decides what goes in.
//
// Schema followed: vLLM's `vllm/distributed/kv_events.py` after
// vllm-project/vllm#42892 (merged 2026-06-09: event structs lose
// `array_like=True`) and #45177 (replay frames carry the topic), as shipped
// since vLLM 0.26 and exercised by vllm-project/vllm 05d3142f485910eab6c3421d
// 8dcf37be44d5eaca (tests/distributed/test_events.py). The decoder it has to
// satisfy is llm-d's: llm-d/llm-d-router 0854a27dfafc990cc41b6c627ee681a089c
// 0685c (pkg/kvevents/engineadapter/vllm_adapter.go, common.go) and
// 1c5d5987396a32fab6b40cf05b84224183842504 (vllm_msgpack.go). That decoder
// requires the batch to be an array and takes each event either as a tagged
// map or as a tag-first array; llm-d-kv-cache before v0.9.0 (f5ae8784, and
// other consumers written against vLLM < 0.26) reads only the arrays.
//
// The batch (always an array, msgspec `array_like=True` as vLLM keeps it):
//   [ts, events, data_parallel_rank]
//     ts                  float64 (msgpack 0xcb): Unix seconds, as
//                         Python's time.time() when the batch was built
//     events              array of events, in the order they happened
//     data_parallel_rank  int: the publisher's rank (0 for pdworker); vLLM
//                         fills it in before encoding, so it is always there
//
// Events, KvEventLayout::kTaggedMap (default; vLLM >= 0.26): a map whose
// "type" key carries the tag, then the fields in vLLM's declaration order
// (consumers select by name; the order is not part of the contract):
//   {"type": "BlockStored", "block_hashes": [u64...],
//    "parent_block_hash": u64 | nil, "token_ids": [int...],
//    "block_size": int, "lora_id": nil, "medium": "GPU", "lora_name": nil,
//    "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
//   {"type": "BlockRemoved", "block_hashes": [u64...], "medium": "GPU",
//    "group_idx": 0}
//   {"type": "AllBlocksCleared"}
// lora_id, medium and lora_name have no default in vLLM's structs and are
// always written (nil when unset); group_idx and kv_cache_spec_kind are what
// vLLM writes for a model with one full-attention KV cache group. Fields
// whose value is vLLM's default (extra_keys, kv_cache_spec_sliding_window,
// locality, ownership, event_version) are omitted, as `omit_defaults=True`
// omits them.
//
// Events, KvEventLayout::kPositional (vLLM < 0.26, `array_like=True`): the
// tag first, then the fields by position, trailing defaults omitted:
//   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//    lora_id=nil, medium, lora_name=nil]
//   ["BlockRemoved", block_hashes, medium]
//   ["AllBlocksCleared"]
//
// Block hashes are msgpack unsigned integers (the ExternalBlockHash, 64
// bits, packed in the smallest width that holds it), as vLLM sends them
// with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; token ids are integers.
#ifndef PDWORKER_WORKER_KV_EVENTS_VLLM_EVENT_BATCH_H_
#define PDWORKER_WORKER_KV_EVENTS_VLLM_EVENT_BATCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/kv_cache/kv_cache_events.h"

namespace pdworker {

enum class KvEventLayout {
  kTaggedMap,   // "map": vLLM >= 0.26, read by llm-d-kv-cache >= v0.9.0
  kPositional,  // "array": vLLM < 0.26, read by every vLLM KV-event consumer
};

// "map" or "array"; INVALID_ARGUMENT naming the accepted values otherwise.
absl::StatusOr<KvEventLayout> ParseKvEventLayout(absl::string_view name);
absl::string_view KvEventLayoutName(KvEventLayout layout);

// What the batch says about its publisher; vLLM's defaults.
struct VllmEventBatchFormat {
  KvEventLayout layout = KvEventLayout::kTaggedMap;
  // Where the blocks live ("GPU" is vLLM's MEDIUM_GPU, the engine's own KV
  // cache; llm-d reads it, lowercased, as the device tier).
  std::string medium = "GPU";
  int32_t data_parallel_rank = 0;
};

// The msgpack bytes of one batch. Every BlockStoredEvent must carry
// block_hashes.size() * block_size token ids (the cache's invariant;
// checked). `timestamp` is Unix seconds.
std::string EncodeVllmEventBatch(absl::Span<const KvCacheEvent> events,
                                 double timestamp,
                                 const VllmEventBatchFormat& format);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_KV_EVENTS_VLLM_EVENT_BATCH_H_
