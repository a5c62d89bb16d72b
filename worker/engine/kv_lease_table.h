// KvLeaseTable: the prefill side of the KV handoff. A Forward with
// hold_for_handoff detaches its sequence's blocks into a lease; a decode
// worker pulls them once (PullKv) and releases them (ReleaseKv); a lease
// nobody releases expires after its TTL. Either way the blocks go back to
// the pool through `free_blocks` (which hands them to the engine thread,
// the KV cache's owner).
//
//   Add ─▶ held ──BeginPull──▶ pulling ──EndPull(sent all)──▶ pulled
//            ▲                    │ EndPull(failed)             │
//            └────────────────────┘                             │
//   held/pulled: Release or expiry frees now; pulling: freed at EndPull.
//   Renew (held or pulling): expiry = now + TTL, for a puller still waiting.
//
// A lease being pulled never expires under the reader (its blocks stay put
// until EndPull). Finished leases leave a tombstone so a late or second
// pull is told why: FAILED_PRECONDITION "already pulled", NOT_FOUND
// "expired". Thread-safe; a sweeper thread expires leases on time.
#ifndef PDWORKER_WORKER_ENGINE_KV_LEASE_TABLE_H_
#define PDWORKER_WORKER_ENGINE_KV_LEASE_TABLE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "metrics/worker_metrics.h"
#include "worker/kv_cache/kv_cache_manager.h"

namespace pdworker {

// 32 hex digits (128 bits) from std::random_device, the kernel's random
// source on Linux: lease ids (a capability, so not guessable from earlier
// ones) and worker epochs (KvHandle.source_epoch).
std::string RandomHexId();

// What a Forward response tells the router about a new lease.
struct KvLeaseInfo {
  std::string lease_id;  // 32 hex digits from the OS's random source
  int32_t num_tokens = 0;
  std::chrono::system_clock::time_point expiry;
};

// What a pull may read: the blocks stay held until EndPull.
struct KvPullGrant {
  std::string sequence_id;
  SequenceKv kv;
};

// Whether a NOT_FOUND message from BeginPull (as a source's PullKv passes
// it on) says the lease expired, rather than that it is unknown or was
// released.
bool SaysLeaseExpired(absl::string_view message);

class KvLeaseTable {
 public:
  // Gives blocks back to the pool; must not block on this table. Called
  // from whichever thread ends the lease, never under the table's lock.
  using FreeBlocks = std::function<void(SequenceKv kv)>;

  // `metrics` may be null. Starts the sweeper.
  KvLeaseTable(std::chrono::milliseconds ttl, FreeBlocks free_blocks,
               WorkerMetrics* metrics);
  // Stops the sweeper. Leases still held are handed to free_blocks.
  ~KvLeaseTable();

  KvLeaseTable(const KvLeaseTable&) = delete;
  KvLeaseTable& operator=(const KvLeaseTable&) = delete;

  // Takes ownership of a detached sequence's blocks.
  KvLeaseInfo Add(absl::string_view sequence_id, SequenceKv kv);

  // Starts the one pull of a held lease. NOT_FOUND: unknown or expired;
  // FAILED_PRECONDITION: being pulled, or already pulled.
  absl::StatusOr<KvPullGrant> BeginPull(absl::string_view lease_id);
  // Ends a pull. `sent_all`: every byte went out (the lease is now pulled
  // and cannot be pulled again); otherwise it is held again (the puller may
  // retry until it expires).
  void EndPull(absl::string_view lease_id, bool sent_all);

  // Pushes a held or pulling lease's expiry to now + TTL (never earlier)
  // and returns it. NOT_FOUND: unknown, expired or released;
  // FAILED_PRECONDITION: already pulled.
  absl::StatusOr<std::chrono::system_clock::time_point> Renew(
      absl::string_view lease_id);

  // Frees a lease: returns the blocks freed now (0 when it is being pulled:
  // freed at EndPull). NOT_FOUND when unknown or already gone.
  absl::StatusOr<int32_t> Release(absl::string_view lease_id);

  // Leases alive (held, pulling or pulled-not-released).
  int64_t size() const;
  // Expires due leases now (the sweeper does this on its own); returns how
  // many expired. For tests.
  int ExpireDue();

 private:
  enum class State { kHeld, kPulling, kPulled };
  struct Lease {
    std::string sequence_id;
    SequenceKv kv;
    std::chrono::system_clock::time_point expiry;
    State state = State::kHeld;
    bool release_requested = false;
  };
  // How a lease ended, for the status a late pull gets. RemoveLocked turns
  // kReleased into kPulledThenReleased for a lease pulled in full.
  enum class Ending { kPulledThenReleased, kReleased, kExpired };

  void Sweep();
  // Removes `it`, leaves a tombstone, and returns the blocks to free.
  SequenceKv RemoveLocked(absl::flat_hash_map<std::string, Lease>::iterator it,
                          Ending ending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status GoneLocked(absl::string_view lease_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the leases gauge; under mu_ so updates are never reordered.
  void Publish(int64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::chrono::milliseconds ttl_;
  const FreeBlocks free_blocks_;
  WorkerMetrics* const metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::flat_hash_map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  // The last kMaxTombstones finished leases, oldest first.
  static constexpr size_t kMaxTombstones = 4096;
  absl::flat_hash_map<std::string, Ending> tombstones_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  std::thread sweeper_;  // last: starts after everything it reads
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_ENGINE_KV_LEASE_TABLE_H_
