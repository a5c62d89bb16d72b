#include "worker/transfer/kv_span_staging.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdworker {

absl::StatusOr<std::unique_ptr<KvSpanStaging>> KvSpanStaging::Create(
    Device& device, size_t capacity_bytes) {
  if (capacity_bytes == 0) {
    return absl::InvalidArgumentError("a KV span staging of 0 bytes");
  }
  std::unique_ptr<KvSpanStaging> staging(new KvSpanStaging());
  staging->device_ = &device;
  PDW_ASSIGN_OR_RETURN(staging->stream_, device.CreateStream());
  staging->fence_ = StreamFence(*staging->stream_);
  PDW_ASSIGN_OR_RETURN(staging->done_, device.CreateEvent());
  PDW_RETURN_IF_ERROR(staging->Allocate(capacity_bytes));
  return staging;
}

absl::Status KvSpanStaging::Allocate(size_t capacity_bytes) {
  // Nothing may still read or write the old buffers.
  PDW_RETURN_IF_ERROR(fence_.Wait());
  packed_ = DeviceMemory();
  host_ = HostMemory();
  capacity_bytes_ = 0;
  PDW_ASSIGN_OR_RETURN(packed_, device_->Allocate(capacity_bytes));
  PDW_ASSIGN_OR_RETURN(host_, device_->AllocateHost(capacity_bytes));
  capacity_bytes_ = capacity_bytes;
  return absl::OkStatus();
}

absl::Status KvSpanStaging::WaitForHostBuffer() {
  if (!recorded_) return absl::OkStatus();
  return done_->Synchronize();
}

absl::Status KvSpanStaging::Gather(const KvCacheView& view,
                                   const SequenceKv& seq, int32_t first_token,
                                   int32_t num_tokens) {
  const int64_t bytes = view.BytesFor(num_tokens);
  if (bytes > static_cast<int64_t>(capacity_bytes_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a span of ", num_tokens, " tokens is ", bytes,
                     " bytes, the staging holds ", capacity_bytes_));
  }
  const DeviceBuffer packed = packed_.buffer().Slice(0, bytes);
  PDW_RETURN_IF_ERROR(
      GatherKvSpan(*stream_, view, seq, first_token, num_tokens, packed));
  PDW_RETURN_IF_ERROR(stream_->CopyToHostAsync(host_.data(), packed, bytes));
  PDW_RETURN_IF_ERROR(stream_->RecordEvent(*done_));
  recorded_ = true;
  return absl::OkStatus();
}

absl::StatusOr<const char*> KvSpanStaging::Gathered() {
  PDW_RETURN_IF_ERROR(WaitForHostBuffer());
  return host_.as<const char>();
}

absl::Status KvSpanStaging::Scatter(absl::string_view bytes,
                                    const KvCacheView& view,
                                    const SequenceKv& seq, int32_t first_token,
                                    int32_t num_tokens) {
  if (static_cast<int64_t>(bytes.size()) != view.BytesFor(num_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a span of ", num_tokens, " tokens is ",
                     view.BytesFor(num_tokens), " bytes, got ", bytes.size()));
  }
  if (bytes.size() > capacity_bytes_) {
    PDW_RETURN_IF_ERROR(Allocate(bytes.size()));
    recorded_ = false;
  }
  PDW_RETURN_IF_ERROR(WaitForHostBuffer());
  std::memcpy(host_.data(), bytes.data(), bytes.size());
  const DeviceBuffer packed = packed_.buffer().Slice(0, bytes.size());
  PDW_RETURN_IF_ERROR(
      stream_->CopyToDevice(packed, host_.data(), bytes.size()));
  // Marks the upload alone: the next Scatter may refill the host buffer
  // while this one's unpacking still runs.
  PDW_RETURN_IF_ERROR(stream_->RecordEvent(*done_));
  recorded_ = true;
  PDW_RETURN_IF_ERROR(
      ScatterKvSpan(*stream_, packed, view, seq, first_token, num_tokens));
  return absl::OkStatus();
}

KvSpanStagingPool::KvSpanStagingPool(Device& device, const KvCacheView& view,
                                     size_t max_chunk_bytes, int max_idle)
    : device_(device),
      span_tokens_(static_cast<int32_t>(
          std::clamp<int64_t>(static_cast<int64_t>(max_chunk_bytes) /
                                  std::max<int64_t>(1, view.BytesFor(1)),
                              1, std::numeric_limits<int32_t>::max()))),
      capacity_bytes_(static_cast<size_t>(
          std::max<int64_t>(1, view.BytesFor(span_tokens_)))),
      max_idle_(max_idle) {}

absl::StatusOr<KvSpanStagingPool::Lease> KvSpanStagingPool::Acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      Lease lease(idle_.back().release(), Returner{this});
      idle_.pop_back();
      return lease;
    }
  }
  PDW_ASSIGN_OR_RETURN(std::unique_ptr<KvSpanStaging> staging,
                       KvSpanStaging::Create(device_, capacity_bytes_));
  return Lease(staging.release(), Returner{this});
}

int KvSpanStagingPool::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(idle_.size());
}

void KvSpanStagingPool::Returner::operator()(KvSpanStaging* staging) const {
  pool->Return(staging);
}

void KvSpanStagingPool::Return(KvSpanStaging* staging) {
  std::unique_ptr<KvSpanStaging> owned(staging);
  // A staging whose stream failed (a faulted device) is not lent again.
  if (!owned->Synchronize().ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int>(idle_.size()) < max_idle_) {
    idle_.push_back(std::move(owned));
  }
}

}  // namespace pdworker
