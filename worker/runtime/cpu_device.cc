#include "worker/runtime/cpu_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "worker/runtime/cpu_event.h"
#include "worker/runtime/cpu_stream.h"

namespace pdworker {
namespace {

// Same alignment cudaMalloc guarantees, so layouts match across backends.
constexpr size_t kAllocationAlignment = 256;
// From this size on, allocations start on a 2 MiB boundary and ask for
// transparent huge pages (MADV_HUGEPAGE; the kernel's default is often
// "madvise"): a 5 GB weights arena then takes ~2,400 page faults to
// populate instead of ~1.2 million.
constexpr size_t kHugePageBytes = size_t{2} << 20;
// A cache line: what Device::AllocateHost promises.
constexpr size_t kHostAllocationAlignment = 64;

// aligned_alloc needs a size that is a multiple of the alignment.
size_t RoundUp(size_t size_bytes, size_t alignment) {
  return (size_bytes + alignment - 1) / alignment * alignment;
}

// Fills [data, data + size_bytes) with `byte`, split over the machine's
// hardware threads when it is large. The first write to a fresh page costs
// the kernel's zeroing of it, which is most of what a large allocation
// costs (a 5 GB weights arena: ~0.7 s on one core of a 2-core VM, more
// than reading the checkpoint from the page cache), and it runs in
// parallel. Pieces are whole huge pages, so no 2 MiB page is faulted by
// two threads.
void ParallelFill(void* data, size_t size_bytes, int byte) {
  constexpr size_t kMinBytesPerThread = size_t{64} << 20;
  const size_t threads =
      std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()),
                       size_bytes / kMinBytesPerThread);
  if (threads <= 1) {
    std::memset(data, byte, size_bytes);
    return;
  }
  const size_t piece = RoundUp(size_bytes / threads, kHugePageBytes);
  auto* bytes = static_cast<unsigned char*>(data);
  std::vector<std::thread> workers;
  for (size_t at = piece; at < size_bytes; at += piece) {
    workers.emplace_back([bytes, at, piece, size_bytes, byte] {
      std::memset(bytes + at, byte, std::min(piece, size_bytes - at));
    });
  }
  std::memset(bytes, byte, std::min(piece, size_bytes));
  for (std::thread& t : workers) t.join();
}

size_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return size_t{1} << 34;  // 16 GiB guess.
  return static_cast<size_t>(pages) * static_cast<size_t>(page_size);
}

}  // namespace

CpuDevice::CpuDevice(const CpuDeviceOptions& options)
    : capacity_bytes_(options.capacity_bytes != 0 ? options.capacity_bytes
                                                  : PhysicalMemoryBytes()),
      memory_init_(options.memory_init),
      stream_execution_(options.stream_execution) {}

absl::StatusOr<MemoryStats> CpuDevice::GetMemoryStats() const {
  MemoryStats stats;
  stats.total_bytes = capacity_bytes_;
  stats.used_bytes = used_bytes_.load(std::memory_order_relaxed);
  stats.free_bytes = capacity_bytes_ - stats.used_bytes;
  return stats;
}

absl::StatusOr<void*> CpuDevice::DoAllocate(size_t size_bytes) {
  // Reserve the bytes first so concurrent allocations cannot overshoot.
  size_t used = used_bytes_.load(std::memory_order_relaxed);
  do {
    if (size_bytes > capacity_bytes_ - used) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cpu device out of memory: %d bytes requested, %d of %d bytes in "
          "use",
          size_bytes, used, capacity_bytes_));
    }
  } while (!used_bytes_.compare_exchange_weak(used, used + size_bytes,
                                              std::memory_order_relaxed));
  const size_t alignment =
      size_bytes >= kHugePageBytes ? kHugePageBytes : kAllocationAlignment;
  const size_t rounded = RoundUp(size_bytes, alignment);
  void* data = std::aligned_alloc(alignment, rounded);
  if (data == nullptr) {
    used_bytes_.fetch_sub(size_bytes, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cpu device: host allocation of %d bytes failed", size_bytes));
  }
  // Advice only: a kernel without THP leaves the pages small.
  if (alignment == kHugePageBytes) madvise(data, rounded, MADV_HUGEPAGE);
  if (memory_init_ == CpuMemoryInit::kPoison) ParallelFill(data, rounded, 0xFF);
  return data;
}

void CpuDevice::DoFree(void* data, size_t size_bytes) noexcept {
  std::free(data);
  used_bytes_.fetch_sub(size_bytes, std::memory_order_relaxed);
}

absl::StatusOr<void*> CpuDevice::DoAllocateHost(size_t size_bytes) {
  const size_t rounded = RoundUp(size_bytes, kHostAllocationAlignment);
  void* data = std::aligned_alloc(kHostAllocationAlignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cpu device: host allocation of %d bytes failed", size_bytes));
  }
  if (memory_init_ == CpuMemoryInit::kPoison) std::memset(data, 0xFF, rounded);
  return data;
}

void CpuDevice::DoFreeHost(void* data, size_t /*size_bytes*/) noexcept {
  std::free(data);
}

absl::StatusOr<std::unique_ptr<Stream>> CpuDevice::DoCreateStream() {
  return std::unique_ptr<Stream>(new CpuStream(*this, stream_execution_));
}

absl::StatusOr<std::unique_ptr<Event>> CpuDevice::DoCreateEvent() {
  return std::unique_ptr<Event>(new CpuEvent());
}

}  // namespace pdworker
