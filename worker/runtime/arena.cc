#include "worker/runtime/arena.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdworker {
namespace {

bool IsPowerOfTwo(size_t value) {
  return value != 0 && (value & (value - 1)) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Arena>> Arena::Create(
    Device& device, const ArenaOptions& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena '", options.name, "': capacity_bytes must be > 0"));
  }
  if (!IsPowerOfTwo(options.alignment_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("arena '%s': alignment_bytes %d is not a power of two",
                        options.name, options.alignment_bytes));
  }
  absl::StatusOr<DeviceMemory> memory = device.Allocate(options.capacity_bytes);
  if (!memory.ok()) {
    return absl::Status(memory.status().code(),
                        absl::StrCat("arena '", options.name,
                                     "': ", memory.status().message()));
  }
  return std::unique_ptr<Arena>(new Arena(device, *std::move(memory), options));
}

Arena::Arena(Device& device, DeviceMemory memory, ArenaOptions options)
    : device_(device),
      memory_(std::move(memory)),
      options_(std::move(options)) {}

absl::StatusOr<DeviceBuffer> Arena::Allocate(size_t size_bytes,
                                             absl::string_view label) {
  absl::Status refused = device_.capture_registry().RefuseDuringCapture(
      absl::StrCat("Arena('", options_.name, "')::Allocate('", label, "')"));
  if (!refused.ok()) return refused;
  if (size_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena '", options_.name, "': buffer '", label, "' of 0 bytes"));
  }
  // The base address is at least alignment-aligned only if the device
  // allocation is; align the absolute address to be safe.
  const uintptr_t base = reinterpret_cast<uintptr_t>(memory_.data());
  const uintptr_t mask = options_.alignment_bytes - 1;
  const uintptr_t aligned = (base + used_bytes_ + mask) & ~mask;
  const size_t offset = aligned - base;
  if (offset > capacity_bytes() || size_bytes > capacity_bytes() - offset) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "arena '%s' exhausted: buffer '%s' needs %d bytes at offset %d, but "
        "the capacity is %d bytes (%d used); size the arena for "
        "max_num_batched_tokens at startup",
        options_.name, label, size_bytes, offset, capacity_bytes(),
        used_bytes_));
  }
  used_bytes_ = offset + size_bytes;
  return DeviceBuffer(static_cast<char*>(memory_.data()) + offset, size_bytes);
}

}  // namespace pdworker
