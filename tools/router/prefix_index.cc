#include "tools/router/prefix_index.h"

#include <algorithm>
#include <exception>
#include <iterator>
#include <msgpack.hpp>
#include <optional>
#include <utility>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "worker/kv_cache/block_hash.h"

namespace pdworker::router {
namespace {

using Clock = std::chrono::steady_clock;

// The replay socket's "no more batches" sequence number.
constexpr uint64_t kReplayEnd = ~uint64_t{0};

std::optional<uint64_t> BigEndian64(const zmq::message_t& frame) {
  if (frame.size() != 8) return std::nullopt;
  const auto* bytes = static_cast<const uint8_t*>(frame.data());
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value = (value << 8) | bytes[i];
  return value;
}

std::string ToString(const msgpack::object& object) {
  if (object.type != msgpack::type::STR) return "";
  return std::string(object.via.str.ptr, object.via.str.size);
}

// A block hash: an unsigned integer, or a signed one with the same bits.
std::optional<uint64_t> ToHash(const msgpack::object& object) {
  if (object.type == msgpack::type::POSITIVE_INTEGER) return object.via.u64;
  if (object.type == msgpack::type::NEGATIVE_INTEGER) {
    return static_cast<uint64_t>(object.via.i64);
  }
  return std::nullopt;
}

// (type, block_hashes) of one event, tagged map or tag-first array; the
// type is empty for anything else.
std::pair<std::string, const msgpack::object*> EventFields(
    const msgpack::object& event) {
  if (event.type == msgpack::type::MAP) {
    std::string type;
    const msgpack::object* hashes = nullptr;
    for (uint32_t i = 0; i < event.via.map.size; ++i) {
      const msgpack::object_kv& kv = event.via.map.ptr[i];
      const std::string key = ToString(kv.key);
      if (key == "type") type = ToString(kv.val);
      if (key == "block_hashes") hashes = &kv.val;
    }
    return {type, hashes};
  }
  if (event.type == msgpack::type::ARRAY && event.via.array.size >= 1) {
    return {ToString(event.via.array.ptr[0]),
            event.via.array.size >= 2 ? &event.via.array.ptr[1] : nullptr};
  }
  return {"", nullptr};
}

}  // namespace

struct PrefixIndex::Subscription {
  std::string worker;
  KvEventEndpoints endpoints;
  std::unique_ptr<zmq::socket_t> sub;
  std::unique_ptr<zmq::socket_t> dealer;  // null without a replay endpoint

  // Event thread only.
  uint64_t next_seq = 0;
  std::map<uint64_t, std::string> pending;  // held back for a gap
  bool replaying = false;
  Clock::time_point replay_sent;
  Clock::time_point last_heard;

  // Guarded by PrefixIndex::mu_.
  std::string fingerprint;
  int32_t block_size = 0;
  bool prefix_caching = false;
  std::unique_ptr<BlockHasher> hasher;
  absl::flat_hash_set<uint64_t> blocks;
  int64_t batches = 0;
};

absl::Status ParseKvEventEndpoints(
    const std::string& flag, bool replay,
    std::map<std::string, KvEventEndpoints>* out) {
  for (absl::string_view entry : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos || eq == 0 || eq + 1 == entry.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected worker=endpoint, got \"", entry, "\""));
    }
    KvEventEndpoints& endpoints = (*out)[std::string(entry.substr(0, eq))];
    std::string& field =
        replay ? endpoints.replay_endpoint : endpoints.endpoint;
    if (!field.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker ", entry.substr(0, eq), " given twice in \"", flag, "\""));
    }
    field = std::string(entry.substr(eq + 1));
  }
  return absl::OkStatus();
}

PrefixIndex::PrefixIndex(const PrefixIndexOptions& options)
    : options_(options), context_(std::make_unique<zmq::context_t>(1)) {}

absl::StatusOr<std::unique_ptr<PrefixIndex>> PrefixIndex::Create(
    const std::map<std::string, KvEventEndpoints>& workers,
    const PrefixIndexOptions& options) {
  std::unique_ptr<PrefixIndex> index(new PrefixIndex(options));
  for (const auto& [worker, endpoints] : workers) {
    if (endpoints.endpoint.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", worker, ": no KV events endpoint"));
    }
    auto sub = std::make_unique<Subscription>();
    sub->worker = worker;
    sub->endpoints = endpoints;
    try {
      sub->sub = std::make_unique<zmq::socket_t>(*index->context_,
                                                 zmq::socket_type::sub);
      sub->sub->set(zmq::sockopt::linger, 0);
      sub->sub->set(zmq::sockopt::subscribe, "");
      sub->sub->connect(endpoints.endpoint);
      if (!endpoints.replay_endpoint.empty()) {
        sub->dealer = std::make_unique<zmq::socket_t>(*index->context_,
                                                      zmq::socket_type::dealer);
        sub->dealer->set(zmq::sockopt::linger, 0);
        sub->dealer->connect(endpoints.replay_endpoint);
      }
    } catch (const zmq::error_t& e) {
      return absl::InternalError(absl::StrCat(
          "worker ", worker, ": KV events sockets (", endpoints.endpoint, ", ",
          endpoints.replay_endpoint, "): ", e.what()));
    }
    index->by_worker_[worker] = sub.get();
    index->subscriptions_.push_back(std::move(sub));
  }
  index->thread_ = std::thread([raw = index.get()] { raw->Run(); });
  return index;
}

PrefixIndex::~PrefixIndex() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  subscriptions_.clear();  // the sockets, before the context
}

void PrefixIndex::SetModel(const std::string& worker,
                           const std::string& fingerprint, int32_t block_size,
                           bool prefix_caching) {
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end()) return;
  Subscription& sub = *it->second;
  std::lock_guard<std::mutex> lock(mu_);
  if (sub.fingerprint == fingerprint && sub.block_size == block_size &&
      sub.prefix_caching == prefix_caching) {
    return;
  }
  sub.fingerprint = fingerprint;
  sub.block_size = block_size;
  sub.prefix_caching = prefix_caching;
  sub.hasher.reset();
  if (!fingerprint.empty() && block_size > 0 &&
      block_size <= kMaxHashedBlockSize) {
    sub.hasher = std::make_unique<BlockHasher>(fingerprint, block_size);
  }
}

int32_t PrefixIndex::LongestPrefixTokens(
    const std::string& worker, absl::Span<const int32_t> prompt) const {
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end() || prompt.empty()) return 0;
  const Subscription& sub = *it->second;
  std::lock_guard<std::mutex> lock(mu_);
  if (!sub.prefix_caching || sub.hasher == nullptr) return 0;
  const int32_t block_size = sub.hasher->block_size();
  const int64_t max_blocks =
      (static_cast<int64_t>(prompt.size()) - 1) / block_size;
  // Block by block: a miss ends the prefix, so a long prompt without one
  // costs one hash.
  BlockHash parent = sub.hasher->root();
  int64_t hit = 0;
  while (hit < max_blocks) {
    parent =
        sub.hasher->Hash(parent, prompt.subspan(hit * block_size, block_size));
    if (!sub.blocks.contains(BlockHasher::External(parent))) break;
    ++hit;
  }
  return static_cast<int32_t>(hit * block_size);
}

int64_t PrefixIndex::NumBlocks(const std::string& worker) const {
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(it->second->blocks.size());
}

int64_t PrefixIndex::NumBatches(const std::string& worker) const {
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  return it->second->batches;
}

void PrefixIndex::RequestReplay(Subscription& sub, uint64_t start) {
  if (sub.dealer == nullptr) return;
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i)
    bytes[i] = static_cast<uint8_t>(start >> (56 - 8 * i));
  try {
    sub.dealer->send(zmq::message_t(), zmq::send_flags::sndmore);
    sub.dealer->send(zmq::buffer(bytes, 8), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    LOG(WARNING) << "KV events replay request to " << sub.worker << ": "
                 << e.what();
    return;
  }
  sub.replaying = true;
  sub.replay_sent = Clock::now();
}

void PrefixIndex::Apply(Subscription& sub, const std::string& payload) {
  // [ts, events, dp_rank]
  msgpack::object_handle handle;
  try {
    handle = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception& e) {
    LOG(WARNING) << "KV events from " << sub.worker
                 << ": undecodable batch: " << e.what();
    return;
  }
  const msgpack::object& batch = handle.get();
  if (batch.type != msgpack::type::ARRAY || batch.via.array.size < 2 ||
      batch.via.array.ptr[1].type != msgpack::type::ARRAY) {
    LOG(WARNING) << "KV events from " << sub.worker << ": not a batch";
    return;
  }
  const msgpack::object& events = batch.via.array.ptr[1];
  std::lock_guard<std::mutex> lock(mu_);
  sub.batches += 1;
  for (uint32_t i = 0; i < events.via.array.size; ++i) {
    const auto [type, hashes] = EventFields(events.via.array.ptr[i]);
    if (type == "AllBlocksCleared") {
      sub.blocks.clear();
      continue;
    }
    const bool stored = type == "BlockStored";
    if ((!stored && type != "BlockRemoved") || hashes == nullptr ||
        hashes->type != msgpack::type::ARRAY) {
      continue;
    }
    for (uint32_t h = 0; h < hashes->via.array.size; ++h) {
      const std::optional<uint64_t> hash = ToHash(hashes->via.array.ptr[h]);
      if (!hash.has_value()) continue;
      if (stored) {
        sub.blocks.insert(*hash);
      } else {
        sub.blocks.erase(*hash);
      }
    }
  }
}

void PrefixIndex::ApplyPending(Subscription& sub) {
  while (!sub.pending.empty() && sub.pending.begin()->first <= sub.next_seq) {
    auto first = sub.pending.begin();
    if (first->first == sub.next_seq) {
      Apply(sub, first->second);
      sub.next_seq += 1;
    }
    sub.pending.erase(first);
  }
}

void PrefixIndex::OnBatch(Subscription& sub, uint64_t seq, std::string payload,
                          bool live) {
  if (seq < sub.next_seq) {
    if (!live) return;  // replayed again
    // Sequence numbers went back: the worker restarted and its cache with
    // it.
    LOG(INFO) << "KV events from " << sub.worker << ": sequence " << seq
              << " after " << sub.next_seq << ", the worker restarted";
    {
      std::lock_guard<std::mutex> lock(mu_);
      sub.blocks.clear();
    }
    sub.next_seq = 0;
    sub.pending.clear();
    sub.replaying = false;
  }
  if (seq == sub.next_seq || sub.dealer == nullptr) {
    // Without replay a gap cannot be filled: apply what comes.
    Apply(sub, payload);
    sub.next_seq = seq + 1;
    ApplyPending(sub);
    return;
  }
  sub.pending.emplace(seq, std::move(payload));
  if (live && !sub.replaying) RequestReplay(sub, sub.next_seq);
}

void PrefixIndex::DrainLive(Subscription& sub) {
  while (true) {
    std::vector<zmq::message_t> frames;
    try {
      if (!zmq::recv_multipart(*sub.sub, std::back_inserter(frames),
                               zmq::recv_flags::dontwait)) {
        return;
      }
    } catch (const zmq::error_t& e) {
      LOG(WARNING) << "KV events from " << sub.worker << ": " << e.what();
      return;
    }
    sub.last_heard = Clock::now();
    // [topic, seq, payload]
    const std::optional<uint64_t> seq =
        frames.size() == 3 ? BigEndian64(frames[1]) : std::nullopt;
    if (!seq.has_value()) continue;
    OnBatch(sub, *seq, frames[2].to_string(), /*live=*/true);
  }
}

void PrefixIndex::DrainReplay(Subscription& sub) {
  while (true) {
    std::vector<zmq::message_t> frames;
    try {
      if (!zmq::recv_multipart(*sub.dealer, std::back_inserter(frames),
                               zmq::recv_flags::dontwait)) {
        return;
      }
    } catch (const zmq::error_t& e) {
      LOG(WARNING) << "KV events replay from " << sub.worker << ": "
                   << e.what();
      return;
    }
    sub.last_heard = Clock::now();
    // ["", topic, seq, payload]
    const std::optional<uint64_t> seq =
        frames.size() == 4 ? BigEndian64(frames[2]) : std::nullopt;
    if (!seq.has_value()) continue;
    if (*seq != kReplayEnd) {
      OnBatch(sub, *seq, frames[3].to_string(), /*live=*/false);
      continue;
    }
    sub.replaying = false;
    if (!sub.pending.empty() && sub.pending.begin()->first > sub.next_seq) {
      // The worker no longer keeps the batches in between.
      LOG(WARNING) << "KV events from " << sub.worker << ": batches "
                   << sub.next_seq << ".." << sub.pending.begin()->first - 1
                   << " are lost; the index may be stale until evictions";
      sub.next_seq = sub.pending.begin()->first;
      ApplyPending(sub);
    }
  }
}

void PrefixIndex::Run() {
  const Clock::time_point now = Clock::now();
  for (auto& sub : subscriptions_) {
    sub->last_heard = now;
    RequestReplay(*sub, 0);  // a late subscriber: everything kept so far
  }
  std::vector<zmq::pollitem_t> items;
  for (auto& sub : subscriptions_) {
    items.push_back({sub->sub->handle(), 0, ZMQ_POLLIN, 0});
    if (sub->dealer != nullptr) {
      items.push_back({sub->dealer->handle(), 0, ZMQ_POLLIN, 0});
    }
  }
  while (!stop_) {
    try {
      zmq::poll(items, std::chrono::milliseconds(50));
    } catch (const zmq::error_t& e) {
      LOG(WARNING) << "KV events poll: " << e.what();
    }
    const Clock::time_point t = Clock::now();
    for (auto& sub : subscriptions_) {
      DrainLive(*sub);
      if (sub->dealer == nullptr) continue;
      DrainReplay(*sub);
      if (sub->replaying ? t - sub->replay_sent >= options_.replay_timeout
                         : t - sub->last_heard >= options_.resync_interval) {
        sub->last_heard = t;
        RequestReplay(*sub, sub->next_seq);
      }
    }
  }
}

}  // namespace pdworker::router
