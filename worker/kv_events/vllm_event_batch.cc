#include "worker/kv_events/vllm_event_batch.h"

#include <cstring>
#include <msgpack.hpp>
#include <type_traits>
#include <variant>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {
namespace {

// msgpack-cxx's packer writes into anything with write(const char*, size_t).
struct StringSink {
  std::string* out;
  void write(const char* data, size_t size) { out->append(data, size); }
};

using Packer = msgpack::packer<StringSink>;

void PackString(Packer& pk, absl::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// msgpack-cxx packs a double whose value is integral as an integer; vLLM's
// ts is always a float64 (0xcb and the IEEE-754 bits, big-endian), as
// msgspec writes every Python float, so it is written out here.
void PackFloat64(std::string* out, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  out->push_back(static_cast<char>(0xcb));
  for (int shift = 56; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>(bits >> shift));
  }
}

void PackHashes(Packer& pk, const std::vector<ExternalBlockHash>& hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const ExternalBlockHash h : hashes) pk.pack_uint64(h);
}

void PackStored(Packer& pk, const BlockStoredEvent& e,
                const VllmEventBatchFormat& format) {
  CHECK_GT(e.block_size, 0) << "BlockStored without a block size";
  CHECK_EQ(e.token_ids.size(), e.block_hashes.size() * e.block_size)
      << "BlockStored: " << e.block_hashes.size() << " blocks of "
      << e.block_size << " tokens carry " << e.token_ids.size() << " tokens";
  const bool map = format.layout == KvEventLayout::kTaggedMap;
  // Each value below follows its key in a map, or takes its slot in the
  // array, in vLLM's declaration order.
  auto key = [&](absl::string_view name) {
    if (map) PackString(pk, name);
  };
  if (map) {
    pk.pack_map(10);
    key("type");
  } else {
    pk.pack_array(8);
  }
  PackString(pk, "BlockStored");
  key("block_hashes");
  PackHashes(pk, e.block_hashes);
  key("parent_block_hash");
  if (e.parent_block_hash.has_value()) {
    pk.pack_uint64(*e.parent_block_hash);
  } else {
    pk.pack_nil();
  }
  key("token_ids");
  pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
  for (const int32_t t : e.token_ids) pk.pack_int32(t);
  key("block_size");
  pk.pack_int32(e.block_size);
  key("lora_id");
  pk.pack_nil();
  key("medium");
  PackString(pk, format.medium);
  key("lora_name");
  pk.pack_nil();
  if (map) {
    key("group_idx");
    pk.pack_int32(0);
    key("kv_cache_spec_kind");
    PackString(pk, "full_attention");
  }
}

void PackRemoved(Packer& pk, const BlockRemovedEvent& e,
                 const VllmEventBatchFormat& format) {
  if (format.layout == KvEventLayout::kTaggedMap) {
    pk.pack_map(4);
    PackString(pk, "type");
    PackString(pk, "BlockRemoved");
    PackString(pk, "block_hashes");
    PackHashes(pk, e.block_hashes);
    PackString(pk, "medium");
    PackString(pk, format.medium);
    PackString(pk, "group_idx");
    pk.pack_int32(0);
  } else {
    pk.pack_array(3);
    PackString(pk, "BlockRemoved");
    PackHashes(pk, e.block_hashes);
    PackString(pk, format.medium);
  }
}

void PackCleared(Packer& pk, const VllmEventBatchFormat& format) {
  if (format.layout == KvEventLayout::kTaggedMap) {
    pk.pack_map(1);
    PackString(pk, "type");
  } else {
    pk.pack_array(1);
  }
  PackString(pk, "AllBlocksCleared");
}

}  // namespace

absl::StatusOr<KvEventLayout> ParseKvEventLayout(absl::string_view name) {
  if (name == "map") return KvEventLayout::kTaggedMap;
  if (name == "array") return KvEventLayout::kPositional;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown KV event layout '", name,
      "': 'map' (vLLM >= 0.26, tagged maps) or 'array' (older vLLM, "
      "positional arrays)"));
}

absl::string_view KvEventLayoutName(KvEventLayout layout) {
  return layout == KvEventLayout::kTaggedMap ? "map" : "array";
}

std::string EncodeVllmEventBatch(absl::Span<const KvCacheEvent> events,
                                 double timestamp,
                                 const VllmEventBatchFormat& format) {
  std::string bytes;
  StringSink sink{&bytes};
  Packer pk(sink);
  pk.pack_array(3);
  PackFloat64(&bytes, timestamp);  // the packer writes through at once
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvCacheEvent& event : events) {
    std::visit(
        [&](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, BlockStoredEvent>) {
            PackStored(pk, e, format);
          } else if constexpr (std::is_same_v<T, BlockRemovedEvent>) {
            PackRemoved(pk, e, format);
          } else {
            PackCleared(pk, format);
          }
        },
        event);
  }
  pk.pack_int32(format.data_parallel_rank);
  return bytes;
}

}  // namespace pdworker
