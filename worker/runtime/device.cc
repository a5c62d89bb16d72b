#include "worker/runtime/device.h"

#include "worker/runtime/event.h"
#include "worker/runtime/stream.h"

namespace pdworker {

absl::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, DeviceKind kind) {
  return os << DeviceKindName(kind);
}

void DeviceMemory::Reset() noexcept {
  if (device_ != nullptr && data_ != nullptr) {
    device_->DoFree(data_, size_bytes_);
  }
  device_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

void HostMemory::Reset() noexcept {
  if (device_ != nullptr && data_ != nullptr) {
    device_->DoFreeHost(data_, size_bytes_);
  }
  device_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

absl::StatusOr<DeviceMemory> Device::Allocate(size_t size_bytes) {
  absl::Status refused =
      capture_registry_.RefuseDuringCapture("Device::Allocate");
  if (!refused.ok()) return refused;
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("Device::Allocate of 0 bytes");
  }
  absl::StatusOr<void*> data = DoAllocate(size_bytes);
  if (!data.ok()) return data.status();
  return DeviceMemory(this, *data, size_bytes);
}

absl::StatusOr<HostMemory> Device::AllocateHost(size_t size_bytes) {
  absl::Status refused =
      capture_registry_.RefuseDuringCapture("Device::AllocateHost");
  if (!refused.ok()) return refused;
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("Device::AllocateHost of 0 bytes");
  }
  absl::StatusOr<void*> data = DoAllocateHost(size_bytes);
  if (!data.ok()) return data.status();
  return HostMemory(this, *data, size_bytes);
}

absl::StatusOr<std::unique_ptr<Stream>> Device::CreateStream() {
  absl::Status refused =
      capture_registry_.RefuseDuringCapture("Device::CreateStream");
  if (!refused.ok()) return refused;
  return DoCreateStream();
}

absl::StatusOr<std::unique_ptr<Event>> Device::CreateEvent() {
  absl::Status refused =
      capture_registry_.RefuseDuringCapture("Device::CreateEvent");
  if (!refused.ok()) return refused;
  return DoCreateEvent();
}

}  // namespace pdworker
