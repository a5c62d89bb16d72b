#include "worker/runtime/cpu_event.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// Records are numbered (generations) so that a marker of an older record,
// reached after a newer one (two streams), cannot complete the newer one.
class CpuEvent::State {
 public:
  // Starts a new record; returns its generation (1, 2, ...).
  uint64_t BeginRecord() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++recorded_;
  }

  // The marker of record `generation` ran with `stream_status`.
  void Reach(uint64_t generation, const absl::Status& stream_status) {
    const auto now = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (generation <= reached_) return;
      reached_ = generation;
      reached_at_ = now;
      status_ = stream_status;
    }
    reached_cv_.notify_all();
  }

  bool recorded() {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_ != 0;
  }

  // Waits for the latest record; its time, or the stream's error.
  absl::StatusOr<std::chrono::steady_clock::time_point> Wait(
      absl::string_view operation) {
    std::unique_lock<std::mutex> lock(mu_);
    if (recorded_ == 0) return NeverRecorded(operation);
    const uint64_t target = recorded_;
    reached_cv_.wait(lock, [this, target]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return reached_ >= target;
    });
    if (!status_.ok()) return status_;
    return reached_at_;
  }

  absl::StatusOr<bool> Query() {
    std::lock_guard<std::mutex> lock(mu_);
    if (recorded_ == 0) return NeverRecorded("Event::Query");
    if (reached_ < recorded_) return false;
    if (!status_.ok()) return status_;
    return true;
  }

 private:
  static absl::Status NeverRecorded(absl::string_view operation) {
    return absl::FailedPreconditionError(
        absl::StrCat(operation, ": the event was never recorded"));
  }

  std::mutex mu_;
  std::condition_variable reached_cv_;
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;  // Latest record; 0: none.
  uint64_t reached_ ABSL_GUARDED_BY(mu_) = 0;   // Latest record reached.
  std::chrono::steady_clock::time_point reached_at_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // The stream's, at reached_.
};

CpuEvent::CpuEvent() : state_(std::make_shared<State>()) {}

CpuWorkQueue::Task CpuEvent::Record() {
  const uint64_t generation = state_->BeginRecord();
  return [state = state_, generation](const absl::Status& stream_status) {
    state->Reach(generation, stream_status);
  };
}

absl::Status CpuEvent::Synchronize() {
  return state_->Wait("Event::Synchronize").status();
}

absl::StatusOr<bool> CpuEvent::Query() { return state_->Query(); }

absl::StatusOr<double> CpuEvent::ElapsedMillisecondsSince(
    const Event& start) const {
  const auto* cpu_start = dynamic_cast<const CpuEvent*>(&start);
  if (cpu_start == nullptr) {
    return absl::InvalidArgumentError(
        "ElapsedMillisecondsSince: start is not a cpu event");
  }
  if (!state_->recorded() || !cpu_start->state_->recorded()) {
    return absl::FailedPreconditionError(
        "ElapsedMillisecondsSince: both events must be recorded");
  }
  // One lock at a time (start may be this event).
  absl::StatusOr<std::chrono::steady_clock::time_point> end_at =
      state_->Wait("ElapsedMillisecondsSince");
  if (!end_at.ok()) return end_at.status();
  absl::StatusOr<std::chrono::steady_clock::time_point> start_at =
      cpu_start->state_->Wait("ElapsedMillisecondsSince");
  if (!start_at.ok()) return start_at.status();
  return std::chrono::duration<double, std::milli>(*end_at - *start_at).count();
}

}  // namespace pdworker
