// UploadRing: pinned host blocks that per-step inputs are written into and
// copied to the device from, one DMA per block and step.
//
// A pageable CopyToDevice costs a host-side staging copy and its own DMA; a
// step that uploads eight small arrays pays that eight times before the
// forward can start. Writing them into one pinned block and copying it with
// Stream::CopyToDeviceAsync costs one. The catch is that the device reads the
// block when the copy runs, possibly steps after the host wrote it (the
// engine keeps several steps in flight), so each step writes the next block
// of a ring, and Next() waits for that block's previous copy to have run
// (with as many blocks as steps in flight, it never waits).
#ifndef PDWORKER_WORKER_RUNTIME_UPLOAD_RING_H_
#define PDWORKER_WORKER_RUNTIME_UPLOAD_RING_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/event.h"
#include "worker/runtime/host_memory.h"
#include "worker/runtime/stream.h"

namespace pdworker {

class UploadRing {
 public:
  // `num_blocks` pinned blocks of `block_bytes` each, and their events, from
  // `device` (at startup). INVALID_ARGUMENT for a zero size or count.
  static absl::StatusOr<std::unique_ptr<UploadRing>> Create(Device& device,
                                                            size_t block_bytes,
                                                            int num_blocks);

  // Moves to the next block once the copy out of it has run, and returns
  // it for the caller to write (valid until the next call). Returns the
  // stream's error if that copy failed; then nothing moves.
  absl::StatusOr<void*> Next();
  // The block Next() returned last (the first block before any call).
  void* current() const { return blocks_[current_].host.data(); }
  size_t block_bytes() const { return block_bytes_; }

  // Copies the first `size_bytes` of the current block into `dst` (in
  // stream order, not during capture) and keeps the block from being
  // handed out again until that copy has run.
  absl::Status Upload(Stream& stream, DeviceBuffer dst, size_t size_bytes);

 private:
  struct Block {
    HostMemory host;
    std::unique_ptr<Event> copied;  // recorded after the last copy out
    bool recorded = false;
  };

  UploadRing(size_t block_bytes, std::vector<Block> blocks)
      : block_bytes_(block_bytes), blocks_(std::move(blocks)) {}

  size_t block_bytes_;
  std::vector<Block> blocks_;
  int current_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_UPLOAD_RING_H_
