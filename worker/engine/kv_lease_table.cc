#include "worker/engine/kv_lease_table.h"

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace pdworker {

std::string RandomHexId() {
  std::random_device random;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    absl::StrAppendFormat(&id, "%08x", static_cast<uint32_t>(random()));
  }
  return id;
}

KvLeaseTable::KvLeaseTable(std::chrono::milliseconds ttl,
                           FreeBlocks free_blocks, WorkerMetrics* metrics)
    : ttl_(ttl), free_blocks_(std::move(free_blocks)), metrics_(metrics) {
  CHECK_GT(ttl.count(), 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Publish(0);
  }
  sweeper_ = std::thread([this] { Sweep(); });
}

KvLeaseTable::~KvLeaseTable() {
  std::vector<SequenceKv> to_free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [id, lease] : leases_) to_free.push_back(std::move(lease.kv));
    leases_.clear();
  }
  cv_.notify_all();
  sweeper_.join();
  for (SequenceKv& kv : to_free) free_blocks_(std::move(kv));
}

KvLeaseInfo KvLeaseTable::Add(absl::string_view sequence_id, SequenceKv kv) {
  KvLeaseInfo info;
  info.lease_id = RandomHexId();
  info.num_tokens = kv.num_tokens;
  info.expiry = std::chrono::system_clock::now() + ttl_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Lease& lease = leases_[info.lease_id];
    lease.sequence_id = std::string(sequence_id);
    lease.kv = std::move(kv);
    lease.expiry = info.expiry;
    Publish(static_cast<int64_t>(leases_.size()));
  }
  // The sweeper sleeps until the earliest expiry it knew of; this one can
  // only be later (same TTL for all), so it need not be woken.
  return info;
}

bool SaysLeaseExpired(absl::string_view message) {
  // GoneLocked's and BeginPull's "KV lease <id> expired".
  return absl::StartsWith(message, "KV lease ") &&
         absl::EndsWith(message, " expired");
}

absl::Status KvLeaseTable::GoneLocked(absl::string_view lease_id) const {
  auto t = tombstones_.find(lease_id);
  if (t == tombstones_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown KV lease '", lease_id,
                                            "' (expired long ago, or never "
                                            "issued by this worker)"));
  }
  switch (t->second) {
    case Ending::kPulledThenReleased:
      // Consumed: the README's "second or late pull".
      return absl::FailedPreconditionError(absl::StrCat(
          "KV lease ", lease_id, " was already pulled (and then released)"));
    case Ending::kReleased:
      return absl::NotFoundError(absl::StrCat(
          "KV lease ", lease_id,
          " was released (ReleaseKv) before it was pulled; its KV is gone"));
    case Ending::kExpired:
      break;
  }
  return absl::NotFoundError(absl::StrCat("KV lease ", lease_id, " expired"));
}

absl::StatusOr<KvPullGrant> KvLeaseTable::BeginPull(
    absl::string_view lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return GoneLocked(lease_id);
  Lease& lease = it->second;
  if (lease.expiry <= std::chrono::system_clock::now()) {
    // Due but not yet swept: as good as expired.
    return absl::NotFoundError(absl::StrCat("KV lease ", lease_id, " expired"));
  }
  switch (lease.state) {
    case State::kPulling:
      return absl::FailedPreconditionError(
          absl::StrCat("KV lease ", lease_id, " is being pulled already"));
    case State::kPulled:
      return absl::FailedPreconditionError(
          absl::StrCat("KV lease ", lease_id, " was already pulled"));
    case State::kHeld:
      break;
  }
  lease.state = State::kPulling;
  return KvPullGrant{lease.sequence_id, lease.kv};
}

void KvLeaseTable::EndPull(absl::string_view lease_id, bool sent_all) {
  SequenceKv to_free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(lease_id);
    CHECK(it != leases_.end()) << "EndPull of unknown lease " << lease_id;
    Lease& lease = it->second;
    CHECK(lease.state == State::kPulling) << lease_id;
    lease.state = sent_all ? State::kPulled : State::kHeld;
    if (lease.release_requested) {
      to_free = RemoveLocked(it, Ending::kReleased);
    } else if (lease.expiry <= std::chrono::system_clock::now()) {
      to_free = RemoveLocked(it, Ending::kExpired);
      if (metrics_ != nullptr) metrics_->IncrementKvLeaseExpiries();
    }
    Publish(static_cast<int64_t>(leases_.size()));
  }
  if (!to_free.blocks.empty()) free_blocks_(std::move(to_free));
}

absl::StatusOr<std::chrono::system_clock::time_point> KvLeaseTable::Renew(
    absl::string_view lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return GoneLocked(lease_id);
  Lease& lease = it->second;
  const auto now = std::chrono::system_clock::now();
  if (lease.expiry <= now) {
    // Due but not yet swept: as good as expired.
    return absl::NotFoundError(absl::StrCat("KV lease ", lease_id, " expired"));
  }
  if (lease.state == State::kPulled) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV lease ", lease_id, " was already pulled: nothing to renew"));
  }
  lease.expiry = std::max(lease.expiry, now + ttl_);
  return lease.expiry;
}

absl::StatusOr<int32_t> KvLeaseTable::Release(absl::string_view lease_id) {
  SequenceKv to_free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(lease_id);
    if (it == leases_.end()) {
      // Whatever ended it, there is nothing left to release.
      return absl::NotFoundError(GoneLocked(lease_id).message());
    }
    if (it->second.state == State::kPulling) {
      it->second.release_requested = true;
      return 0;
    }
    to_free = RemoveLocked(it, Ending::kReleased);
    Publish(static_cast<int64_t>(leases_.size()));
  }
  const int32_t freed = static_cast<int32_t>(to_free.blocks.size());
  if (freed > 0) free_blocks_(std::move(to_free));
  return freed;
}

int64_t KvLeaseTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(leases_.size());
}

SequenceKv KvLeaseTable::RemoveLocked(
    absl::flat_hash_map<std::string, Lease>::iterator it, Ending ending) {
  if (ending == Ending::kReleased && it->second.state == State::kPulled) {
    ending = Ending::kPulledThenReleased;
  }
  SequenceKv kv = std::move(it->second.kv);
  std::string id = it->first;
  leases_.erase(it);
  if (tombstone_order_.size() == kMaxTombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
  tombstones_[id] = ending;
  tombstone_order_.push_back(std::move(id));
  return kv;
}

int KvLeaseTable::ExpireDue() {
  std::vector<SequenceKv> to_free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::system_clock::now();
    for (auto it = leases_.begin(); it != leases_.end();) {
      auto next = std::next(it);
      // A lease being pulled keeps its blocks until EndPull (which expires
      // it then if it is due).
      if (it->second.expiry <= now && it->second.state != State::kPulling) {
        LOG(WARNING) << "KV lease " << it->first << " of sequence '"
                     << it->second.sequence_id << "' ("
                     << it->second.kv.num_tokens
                     << " tokens) expired before a decode worker released it";
        to_free.push_back(RemoveLocked(it, Ending::kExpired));
      }
      it = next;
    }
    Publish(static_cast<int64_t>(leases_.size()));
  }
  if (metrics_ != nullptr) {
    for (size_t i = 0; i < to_free.size(); ++i) {
      metrics_->IncrementKvLeaseExpiries();
    }
  }
  for (SequenceKv& kv : to_free) free_blocks_(std::move(kv));
  return static_cast<int>(to_free.size());
}

void KvLeaseTable::Sweep() {
  // Wakes at the earliest expiry (or every ttl when idle), so a lease is
  // freed within a few milliseconds of its expiry.
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) return;
      auto wake = std::chrono::system_clock::now() + ttl_;
      for (const auto& [id, lease] : leases_) {
        if (lease.state != State::kPulling) {
          wake = std::min(wake, lease.expiry);
        }
      }
      // A pulling lease is re-checked at least every 100 ms.
      wake = std::min(wake, std::chrono::system_clock::now() +
                                std::chrono::milliseconds(100));
      cv_.wait_until(lock, wake, [this] { return stopping_; });
      if (stopping_) return;
    }
    ExpireDue();
  }
}

void KvLeaseTable::Publish(int64_t size) {
  if (metrics_ != nullptr) metrics_->SetKvLeases(size);
}

}  // namespace pdworker
