// NcclCommCache: the NCCL communicators a worker keeps, one per (source,
// puller) pair of workers, made on the pair's first NCCL pull and reused by
// the later ones (making one costs hundreds of milliseconds).
//
//   puller (rank 0)                              source (rank 1)
//   Acquire(source address, source epoch)
//     none kept: new generation G, unique id U
//   PullKv {puller id, G, U} ──────────────────▶ Open(puller id, G, U):
//                                                  replaces what it kept
//   Join ◀────────── both ranks join U ─────────▶ Join
//   Recv ◀──────────────────────────────────────  Send
//   next pull: Acquire → G, joined
//   PullKv {puller id, G} ─────────────────────▶ Open(puller id, G): the
//                                                  kept one, or NOT_FOUND
//                                                  (the puller makes a new
//                                                  generation)
//
// A Lease is the exclusive use of one communicator: transfers over a pair
// are serialized (NCCL's point-to-point calls on one communicator must
// match in order on both ranks, and a communicator is not thread-safe).
// A communicator is dropped (ncclCommAbort, which never waits for the
// peer) when a Join, Send or Recv through it fails, when its holder says
// the peer went away (Lease::Drop), when the puller's source restarted
// (another epoch) or the source's puller sent a new generation, to make
// room for another peer (the least recently used idle one; at most
// `max_peers` exist, each costing device memory: see nccl_transfer.h), and
// at Shutdown. One dropped while in use is aborted by its holder: the
// holder's wait sees NcclWait::abort and gives up at once, so a waiter for
// the pair, or the worker's shutdown, never waits out a dead peer's
// deadline.
//
// The bookkeeping is NCCL-free: an NcclCommFactory makes the communicators
// (NCCL's in nccl_transfer.h, a fake in tests). Thread-safe.
#ifndef PDWORKER_WORKER_TRANSFER_NCCL_COMM_CACHE_H_
#define PDWORKER_WORKER_TRANSFER_NCCL_COMM_CACHE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// A worker's side of a KV pair: the puller receives, the source sends.
enum class NcclRank { kPuller = 0, kSource = 1 };

// What bounds one blocking NCCL call: its deadline, and `abort`, which the
// cache sets when the communicator is dropped under its user.
struct NcclWait {
  std::chrono::steady_clock::time_point deadline;
  const std::atomic<bool>* abort = nullptr;  // null: only the deadline

  bool aborted() const {
    return abort != nullptr && abort->load(std::memory_order_relaxed);
  }
};

// One rank's side of a joined 2-rank communicator. Destroying it releases
// the communicator without waiting for the peer (ncclCommAbort), stopping
// any transfer still queued on it.
class NcclComm {
 public:
  virtual ~NcclComm() = default;
  // Sends (source) / receives (puller) `bytes` bytes at `data` (device
  // memory) to / from the other rank, in `stream` order after the work
  // already queued there, and returns once they have moved. UNAVAILABLE
  // when the peer failed or did not take part by `wait.deadline`, or
  // `wait.abort` was set; the communicator is unusable then.
  virtual absl::Status Send(const void* data, size_t bytes, Stream& stream,
                            const NcclWait& wait) = 0;
  virtual absl::Status Recv(void* data, size_t bytes, Stream& stream,
                            const NcclWait& wait) = 0;
};

// Makes the communicators.
class NcclCommFactory {
 public:
  virtual ~NcclCommFactory() = default;
  // A fresh unique id for a new pair (the puller makes it; NCCL: the 128
  // bytes of an ncclUniqueId).
  virtual absl::StatusOr<std::string> NewUniqueId() = 0;
  // Joins the pair `unique_id` as `rank`, on the calling thread's current
  // device, once the other rank joins too. UNAVAILABLE when it does not by
  // `wait.deadline` or `wait.abort` is set (nothing is left behind).
  virtual absl::StatusOr<std::unique_ptr<NcclComm>> Join(
      const std::string& unique_id, NcclRank rank, const NcclWait& wait) = 0;
};

class NcclCommCache {
 public:
  class Lease;

  // `factory` must outlive the cache; `max_peers` > 0 communicators at
  // most (kept, in use and being made together).
  NcclCommCache(NcclCommFactory& factory, int max_peers);
  // Shutdown(), then destroys what is left. No lease may be outstanding.
  ~NcclCommCache();

  NcclCommCache(const NcclCommCache&) = delete;
  NcclCommCache& operator=(const NcclCommCache&) = delete;

  // Puller side: the communicator kept for `peer` (the source's address),
  // waiting while another transfer uses it; a new generation with a fresh
  // unique id (not joined) when none is kept, or the one kept was made for
  // another `peer_epoch` (the source restarted: the old one is dropped).
  // DEADLINE_EXCEEDED when it is still in use at `deadline`;
  // RESOURCE_EXHAUSTED when a new one is needed and all max_peers are in
  // use; UNAVAILABLE after Shutdown; the factory's error for the id.
  absl::StatusOr<Lease> Acquire(const std::string& peer,
                                const std::string& peer_epoch,
                                std::chrono::steady_clock::time_point deadline);

  // Source side, never blocking (it runs on gRPC callback threads): with a
  // `unique_id`, a new communicator (not joined) for `peer` (the puller's
  // id) at the puller's `generation`, replacing the one kept for `peer`;
  // without, the one kept for `peer` at `generation`, or NOT_FOUND when
  // there is none (never made here, dropped, replaced, or this worker
  // restarted) or it is in use. An empty `peer` (a puller that keeps no
  // communicators) gets a single-use communicator from `unique_id`.
  // RESOURCE_EXHAUSTED / UNAVAILABLE as for Acquire.
  absl::StatusOr<Lease> Open(const std::string& peer, int64_t generation,
                             const std::string& unique_id);

  // Drops every communicator: idle ones now, ones in use when their holder
  // (told through NcclWait::abort) releases them. Later calls get
  // UNAVAILABLE. Idempotent.
  void Shutdown();

  // Communicators that exist (kept, in use, being made).
  int size() const;
  // Acquire calls waiting for a communicator in use.
  int waiting() const;

 private:
  struct Entry;

  // Unkeeps `it`: destroys it now when idle (its communicator appended to
  // `dead`, to be destroyed outside mu_), else has its holder drop it.
  void DropLocked(
      absl::flat_hash_map<std::string, std::shared_ptr<Entry>>::iterator it,
      std::vector<std::unique_ptr<NcclComm>>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for one more communicator, dropping the least recently used idle
  // one if all max_peers exist.
  absl::Status MakeRoomLocked(std::vector<std::unique_ptr<NcclComm>>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new entry, in use, counted (kept under `key` unless it is empty).
  std::shared_ptr<Entry> AddLocked(const std::string& key,
                                   const std::string& peer_epoch,
                                   int64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(const std::shared_ptr<Entry>& entry);

  NcclCommFactory& factory_;
  const int max_peers_;

  mutable std::mutex mu_;
  std::condition_variable released_;  // a lease ended
  // By "source <address>" (ours as a puller) and "puller <id>" (ours as a
  // source): the pairs' communicators, idle or in use.
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> kept_
      ABSL_GUARDED_BY(mu_);
  int live_ ABSL_GUARDED_BY(mu_) = 0;     // kept + dropped but still held
  int in_use_ ABSL_GUARDED_BY(mu_) = 0;   // leases outstanding
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;  // Acquire calls waiting
  int64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;  // for least recently used
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// The exclusive use of one communicator until destroyed; movable. Releasing
// it keeps the communicator for the pair's next transfer, unless it was
// never joined, a call through it failed, Drop was called, or the cache
// dropped it meanwhile.
class NcclCommCache::Lease {
 public:
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  ~Lease();

  // The pair's generation (the puller numbers them) and, until joined, the
  // unique id both ranks join.
  int64_t generation() const;
  const std::string& unique_id() const;
  // False: a new communicator; Join before Send / Recv.
  bool joined() const;

  // Joins as `rank` (both ranks join the same unique id). A no-op once
  // joined.
  absl::Status Join(NcclRank rank,
                    std::chrono::steady_clock::time_point deadline);
  // NcclComm::Send / Recv through the joined communicator. On failure the
  // communicator is aborted before they return (so a transfer still queued
  // stops before the caller frees `data`) and dropped.
  absl::Status Send(const void* data, size_t bytes, Stream& stream,
                    std::chrono::steady_clock::time_point deadline);
  absl::Status Recv(void* data, size_t bytes, Stream& stream,
                    std::chrono::steady_clock::time_point deadline);

  // Drop the communicator at release: the peer went away, or will not keep
  // its side.
  void Drop();

 private:
  friend class NcclCommCache;
  Lease(NcclCommCache* cache, std::shared_ptr<Entry> entry);
  NcclWait WaitUntil(std::chrono::steady_clock::time_point deadline) const;
  // Aborts and drops the communicator after a failed call.
  void Fail();

  NcclCommCache* cache_ = nullptr;
  std::shared_ptr<Entry> entry_;  // null once moved from
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_NCCL_COMM_CACHE_H_
