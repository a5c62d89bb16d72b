#include "worker/runtime/upload_ring.h"

#include <utility>

namespace pdworker {

absl::StatusOr<std::unique_ptr<UploadRing>> UploadRing::Create(
    Device& device, size_t block_bytes, int num_blocks) {
  if (block_bytes == 0 || num_blocks <= 0) {
    return absl::InvalidArgumentError(
        "UploadRing: block_bytes and num_blocks must be positive");
  }
  std::vector<Block> blocks(num_blocks);
  for (Block& b : blocks) {
    absl::StatusOr<HostMemory> host = device.AllocateHost(block_bytes);
    if (!host.ok()) return host.status();
    b.host = *std::move(host);
    absl::StatusOr<std::unique_ptr<Event>> event = device.CreateEvent();
    if (!event.ok()) return event.status();
    b.copied = *std::move(event);
  }
  return std::unique_ptr<UploadRing>(
      new UploadRing(block_bytes, std::move(blocks)));
}

absl::StatusOr<void*> UploadRing::Next() {
  const int next = (current_ + 1) % static_cast<int>(blocks_.size());
  Block& b = blocks_[next];
  if (b.recorded) {
    absl::Status copied = b.copied->Synchronize();
    if (!copied.ok()) return copied;
    b.recorded = false;
  }
  current_ = next;
  return b.host.data();
}

absl::Status UploadRing::Upload(Stream& stream, DeviceBuffer dst,
                                size_t size_bytes) {
  Block& b = blocks_[current_];
  absl::Status status = stream.CopyToDeviceAsync(dst, b.host, size_bytes);
  if (!status.ok()) return status;
  status = stream.RecordEvent(*b.copied);
  if (!status.ok()) {
    // The copy is queued but nothing marks when it has run: wait for it
    // here, or Next() could hand the block out while the copy still reads
    // it. (A faulted stream returns at once: it runs nothing more.)
    stream.Synchronize().IgnoreError();
    return status;
  }
  b.recorded = true;
  return absl::OkStatus();
}

}  // namespace pdworker
