#include "worker/runtime/stream_fence.h"

#include <utility>

#include "glog/logging.h"

namespace pdworker {

StreamFence::~StreamFence() {
  const absl::Status waited = Wait();
  LOG_IF(WARNING, !waited.ok())
      << "StreamFence: releasing memory after a failed wait: " << waited;
}

StreamFence::StreamFence(StreamFence&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

StreamFence& StreamFence::operator=(StreamFence&& other) noexcept {
  if (this != &other) {
    const absl::Status waited = Wait();
    LOG_IF(WARNING, !waited.ok())
        << "StreamFence: releasing memory after a failed wait: " << waited;
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

absl::Status StreamFence::Wait() {
  if (stream_ == nullptr) return absl::OkStatus();
  return stream_->Synchronize();
}

}  // namespace pdworker
