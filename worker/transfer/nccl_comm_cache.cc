#include "worker/transfer/nccl_comm_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

struct NcclCommCache::Entry {
  std::string key;  // in kept_; empty: single use, not kept
  std::string peer_epoch;
  int64_t generation = 0;
  // Written by the holder before it shares the lease; read by the holder.
  std::string unique_id;
  // Null until joined. Touched by the holder while in use, else under mu_.
  std::unique_ptr<NcclComm> comm;
  // Under mu_.
  bool in_use = false;
  bool drop = false;  // release destroys it
  uint64_t last_used = 0;
  // Set under mu_ when dropped while in use; the holder's waits poll it.
  std::atomic<bool> abort{false};
};

NcclCommCache::NcclCommCache(NcclCommFactory& factory, int max_peers)
    : factory_(factory), max_peers_(max_peers) {
  CHECK_GT(max_peers, 0);
}

NcclCommCache::~NcclCommCache() {
  Shutdown();
  std::lock_guard<std::mutex> lock(mu_);
  CHECK_EQ(in_use_, 0) << "NcclCommCache destroyed with leases outstanding";
}

void NcclCommCache::DropLocked(
    absl::flat_hash_map<std::string, std::shared_ptr<Entry>>::iterator it,
    std::vector<std::unique_ptr<NcclComm>>* dead) {
  std::shared_ptr<Entry> entry = std::move(it->second);
  kept_.erase(it);
  if (entry->in_use) {
    entry->drop = true;
    entry->abort.store(true, std::memory_order_relaxed);
    return;
  }
  dead->push_back(std::move(entry->comm));
  --live_;
}

absl::Status NcclCommCache::MakeRoomLocked(
    std::vector<std::unique_ptr<NcclComm>>* dead) {
  if (live_ < max_peers_) return absl::OkStatus();
  auto lru = kept_.end();
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    if (it->second->in_use) continue;
    if (lru == kept_.end() || it->second->last_used < lru->second->last_used) {
      lru = it;
    }
  }
  if (lru == kept_.end()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "all ", max_peers_,
        " NCCL communicators (--nccl_max_peers) are in use or being made"));
  }
  DropLocked(lru, dead);
  return absl::OkStatus();
}

std::shared_ptr<NcclCommCache::Entry> NcclCommCache::AddLocked(
    const std::string& key, const std::string& peer_epoch, int64_t generation) {
  auto entry = std::make_shared<Entry>();
  entry->key = key;
  entry->peer_epoch = peer_epoch;
  entry->generation = generation;
  entry->in_use = true;
  entry->drop = key.empty();
  ++in_use_;
  ++live_;
  if (!key.empty()) kept_[key] = entry;
  return entry;
}

absl::StatusOr<NcclCommCache::Lease> NcclCommCache::Acquire(
    const std::string& peer, const std::string& peer_epoch,
    std::chrono::steady_clock::time_point deadline) {
  if (peer.empty()) return absl::InvalidArgumentError("no NCCL peer named");
  // A worker that is both a puller and a source keeps both kinds here.
  const std::string key = absl::StrCat("source ", peer);
  // Declared before the lock: destroyed (aborted) after it is released.
  std::vector<std::unique_ptr<NcclComm>> dead;
  std::shared_ptr<Entry> made;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopping_) {
        return absl::UnavailableError("the worker is shutting down");
      }
      auto it = kept_.find(key);
      if (it != kept_.end() && it->second->peer_epoch != peer_epoch) {
        DropLocked(it, &dead);  // made with a previous process of the peer
        it = kept_.end();
      }
      if (it == kept_.end()) break;
      const std::shared_ptr<Entry>& entry = it->second;
      if (!entry->in_use) {
        entry->in_use = true;
        ++in_use_;
        return Lease(this, entry);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the NCCL communicator with ", peer,
            " stayed in use by another transfer past the deadline"));
      }
      ++waiting_;
      released_.wait_until(lock, deadline);
      --waiting_;
    }
    absl::Status room = MakeRoomLocked(&dead);
    if (!room.ok()) return room;
    made = AddLocked(key, peer_epoch, ++last_generation_);
  }
  Lease lease(this, std::move(made));
  absl::StatusOr<std::string> id = factory_.NewUniqueId();
  if (!id.ok()) return id.status();  // the lease drops it: never joined
  lease.entry_->unique_id = *std::move(id);
  return lease;
}

absl::StatusOr<NcclCommCache::Lease> NcclCommCache::Open(
    const std::string& peer, int64_t generation, const std::string& unique_id) {
  std::vector<std::unique_ptr<NcclComm>> dead;
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the worker is shutting down");
    const std::string key = peer.empty() ? "" : absl::StrCat("puller ", peer);
    auto it = key.empty() ? kept_.end() : kept_.find(key);
    if (unique_id.empty()) {
      if (peer.empty()) {
        return absl::InvalidArgumentError(
            "an NCCL pull needs a unique id or a kept communicator's puller "
            "id and generation");
      }
      if (it == kept_.end() || it->second->generation != generation ||
          it->second->in_use) {
        return absl::NotFoundError(absl::StrCat(
            "no NCCL communicator of generation ", generation,
            " with this puller here (never made, dropped, replaced, or this "
            "worker restarted): send a new unique id"));
      }
      it->second->in_use = true;
      ++in_use_;
      return Lease(this, it->second);
    }
    // The puller made a new generation: whatever we kept for it is stale.
    if (it != kept_.end()) DropLocked(it, &dead);
    absl::Status room = MakeRoomLocked(&dead);
    if (!room.ok()) return room;
    entry = AddLocked(key, "", generation);
  }
  entry->unique_id = unique_id;
  return Lease(this, std::move(entry));
}

void NcclCommCache::Release(const std::shared_ptr<Entry>& entry) {
  std::unique_ptr<NcclComm> dead;  // destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lock(mu_);
    entry->in_use = false;
    --in_use_;
    auto it = entry->key.empty() ? kept_.end() : kept_.find(entry->key);
    const bool kept = it != kept_.end() && it->second == entry;
    if (kept && !entry->drop && entry->comm != nullptr && !stopping_) {
      entry->last_used = ++tick_;
    } else {
      if (kept) kept_.erase(it);
      dead = std::move(entry->comm);
      --live_;
    }
  }
  released_.notify_all();
}

void NcclCommCache::Shutdown() {
  std::vector<std::unique_ptr<NcclComm>> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    while (!kept_.empty()) DropLocked(kept_.begin(), &dead);
  }
  released_.notify_all();
}

int NcclCommCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_;
}

int NcclCommCache::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

NcclCommCache::Lease::Lease(NcclCommCache* cache, std::shared_ptr<Entry> entry)
    : cache_(cache), entry_(std::move(entry)) {}

NcclCommCache::Lease::Lease(Lease&& other) noexcept
    : cache_(other.cache_), entry_(std::move(other.entry_)) {}

NcclCommCache::Lease& NcclCommCache::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (entry_ != nullptr) cache_->Release(entry_);
    cache_ = other.cache_;
    entry_ = std::move(other.entry_);
  }
  return *this;
}

NcclCommCache::Lease::~Lease() {
  if (entry_ != nullptr) cache_->Release(entry_);
}

int64_t NcclCommCache::Lease::generation() const { return entry_->generation; }

const std::string& NcclCommCache::Lease::unique_id() const {
  return entry_->unique_id;
}

bool NcclCommCache::Lease::joined() const { return entry_->comm != nullptr; }

NcclWait NcclCommCache::Lease::WaitUntil(
    std::chrono::steady_clock::time_point deadline) const {
  return NcclWait{deadline, &entry_->abort};
}

absl::Status NcclCommCache::Lease::Join(
    NcclRank rank, std::chrono::steady_clock::time_point deadline) {
  if (joined()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<NcclComm>> comm =
      cache_->factory_.Join(entry_->unique_id, rank, WaitUntil(deadline));
  std::lock_guard<std::mutex> lock(cache_->mu_);
  if (!comm.ok()) {
    entry_->drop = true;
    return comm.status();
  }
  entry_->comm = *std::move(comm);
  return absl::OkStatus();
}

absl::Status NcclCommCache::Lease::Send(
    const void* data, size_t bytes, Stream& stream,
    std::chrono::steady_clock::time_point deadline) {
  if (!joined()) return absl::FailedPreconditionError("Send before Join");
  absl::Status sent =
      entry_->comm->Send(data, bytes, stream, WaitUntil(deadline));
  if (!sent.ok()) Fail();
  return sent;
}

absl::Status NcclCommCache::Lease::Recv(
    void* data, size_t bytes, Stream& stream,
    std::chrono::steady_clock::time_point deadline) {
  if (!joined()) return absl::FailedPreconditionError("Recv before Join");
  absl::Status received =
      entry_->comm->Recv(data, bytes, stream, WaitUntil(deadline));
  if (!received.ok()) Fail();
  return received;
}

void NcclCommCache::Lease::Drop() {
  std::lock_guard<std::mutex> lock(cache_->mu_);
  entry_->drop = true;
}

void NcclCommCache::Lease::Fail() {
  std::unique_ptr<NcclComm> dead;
  {
    std::lock_guard<std::mutex> lock(cache_->mu_);
    entry_->drop = true;
    dead = std::move(entry_->comm);
  }
  // `dead` aborts here, on the holder's thread, before the caller returns.
}

}  // namespace pdworker
