// KV imports' reservations: blocks (and, for a decode leg, a running seat)
// for a sequence whose KV another worker computed. A reservation waits in
// the engine's queue for room as a request's admission does, in arrival
// order with the waiting requests, bounded by its wait deadline and its
// client's; it never preempts a running request, and a full cache is no
// reason to fail it while its wait lasts. Engine-thread code except Submit
// and GiveBackKvReservation.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_work.h"

namespace pdworker {

void Engine::Submit(std::unique_ptr<KvReservationCall> call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) incoming_reservations_.push_back(std::move(call));
  }
  if (call == nullptr) {
    work_cv_.notify_one();
    return;
  }
  call->done(absl::UnavailableError("the worker is shutting down"));
}

absl::Status Engine::GiveBackKvReservation(const std::string& sequence_id,
                                           SequenceKv kv) {
  return RunExclusive([this, &sequence_id, &kv](ModelRunner& runner) {
    runner.FreeDetached(kv);
    import_seats_.erase(sequence_id);
    ++progress_;
    return absl::OkStatus();
  });
}

size_t Engine::AdmissibleBeforeReservations() const {
  if (reservations_.empty()) return waiting_.size();
  const uint64_t oldest = reservations_.front()->ticket;
  size_t n = 0;
  while (n < waiting_.size() && waiting_[n]->ticket < oldest) ++n;
  return n;
}

void Engine::ServeKvReservations() {
  bool draining = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining = draining_;
    while (!incoming_reservations_.empty()) {
      auto r = std::make_unique<Reservation>();
      r->call = std::move(incoming_reservations_.front());
      incoming_reservations_.pop_front();
      r->ticket = next_ticket_++;
      reservations_.push_back(std::move(r));
      ++progress_;
    }
  }
  if (reservations_.empty()) return;
  // Ends the reservation at `it` with `status` (it reserved nothing).
  auto end = [this](auto it, const absl::Status& status) {
    std::unique_ptr<KvReservationCall> call = std::move((*it)->call);
    auto next = reservations_.erase(it);
    ++progress_;
    // Before answering: a client that reads the worker's state next sees
    // the import gone.
    PublishSnapshot();
    call->done(status);
    return next;
  };

  // 0. A draining worker takes no new sequence: an import still waiting
  // for room reserved nothing, so it ends now and its router imports on
  // another decode worker (the prefill worker's lease is untouched) instead
  // of waiting out --kv_import_wait_timeout here.
  if (draining) {
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      it = end(it, absl::UnavailableError(
                       "the worker is draining (shutting down) and takes no "
                       "new sequences: import the KV on another worker; "
                       "nothing was reserved"));
    }
    return;
  }

  // 1. Withdrawn by the client while waiting.
  auto now = std::chrono::system_clock::now();
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    const CallControl* control = (*it)->call->control.get();
    const std::atomic<bool>* gone = (*it)->call->source_gone.get();
    if (gone != nullptr && gone->load(std::memory_order_acquire)) {
      it = end(it, absl::NotFoundError(
                       "the import's source is gone (its lease expired or was "
                       "released) while it waited for KV room; nothing was "
                       "reserved"));
    } else if (control != nullptr && now >= control->deadline) {
      it = end(it, absl::DeadlineExceededError(
                       "the import's deadline passed while it waited for KV "
                       "room; nothing was reserved"));
    } else if (control != nullptr &&
               control->cancelled.load(std::memory_order_acquire)) {
      it = end(it, absl::CancelledError(
                       "the client cancelled the import while it waited for "
                       "KV room; nothing was reserved"));
    } else {
      ++it;
    }
  }

  // 2. Granted in arrival order while room lasts: the oldest waits for an
  // older waiting request and for room, and the younger ones wait behind it.
  const KvCacheManager& cache = runner_.kv_cache();
  const size_t max_seats = static_cast<size_t>(runner_.options().max_num_seqs);
  while (!reservations_.empty()) {
    Reservation& head = *reservations_.front();
    const KvReservationCall& call = *head.call;
    if (!waiting_.empty() && waiting_.front()->ticket < head.ticket) break;
    if (cache.Find(call.sequence_id) != nullptr) {
      end(reservations_.begin(),
          absl::AlreadyExistsError(absl::StrCat("sequence '", call.sequence_id,
                                                "' already exists")));
      continue;
    }
    if (call.imported_as == ImportedAs::kRunningRequest &&
        running_.size() + import_seats_.size() >= max_seats) {
      break;
    }
    // Room: its blocks less the cached ones some sequence holds (hits on
    // free cached blocks take free blocks, as new ones would).
    int32_t held_hits = 0;
    if (cache.prefix_caching() == PrefixCaching::kOn &&
        static_cast<int32_t>(call.token_ids.size()) == call.num_tokens) {
      if (!head.hashed) {
        cache.hasher().HashFullBlocks(call.token_ids, &head.block_hashes);
        head.hashed = true;
      }
      held_hits =
          cache.Lookup(head.block_hashes, call.num_tokens).num_held_blocks;
    }
    const int32_t blocks =
        (call.num_tokens + cache.block_size() - 1) / cache.block_size();
    if (call.num_tokens > 0 && blocks - held_hits > cache.Stats().free_blocks) {
      break;
    }
    // The import writes these blocks off the stream: no step may still be
    // writing them (a step in flight writes blocks an abort just freed).
    RetireSteps(0);
    KvReservation reservation;
    absl::StatusOr<SequenceKv> kv = runner_.AllocateDetached(
        call.num_tokens, call.token_ids, &reservation.cached_tokens);
    if (absl::IsResourceExhausted(kv.status())) break;  // waits on
    std::unique_ptr<KvReservationCall> granted = std::move(head.call);
    reservations_.pop_front();
    ++progress_;
    if (!kv.ok()) {
      PublishSnapshot();
      granted->done(kv.status());
      continue;
    }
    reservation.kv = *std::move(kv);
    if (granted->imported_as == ImportedAs::kRunningRequest) {
      import_seats_.insert(granted->sequence_id);
    }
    PublishSnapshot();
    granted->done(std::move(reservation));
  }

  // 3. Out of time to wait.
  now = std::chrono::system_clock::now();
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    const KvReservationCall& call = *(*it)->call;
    if (now < call.wait_deadline) {
      ++it;
      continue;
    }
    const KvCacheStats stats = cache.Stats();
    it = end(
        it, absl::ResourceExhaustedError(absl::StrCat(
                "no room for the imported sequence '", call.sequence_id,
                "' within its wait: ", call.num_tokens, " tokens need ",
                (call.num_tokens + cache.block_size() - 1) / cache.block_size(),
                " KV blocks, ", stats.free_blocks, " of ", stats.total_blocks,
                " free; ", running_.size(), " requests running of ",
                runner_.options().max_num_seqs,
                " (max_num_seqs); nothing was reserved")));
  }
}

}  // namespace pdworker
