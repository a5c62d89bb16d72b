// KvSpanStaging: what a KV_CHUNK_LAYOUT_TOKEN_SPAN PullKv stream moves its
// chunks through, on either side. A chunk is a packed span (GatherKvSpan):
// the source packs it on its device in one launch and copies it down into
// pinned host memory in one copy; the puller copies the received bytes into
// pinned memory, up in one copy, and unpacks them in one launch. Today's
// layer-run stream instead makes one pageable copy per block, layer and
// part (4,096 for a 2,048-token prompt of the 1B shape).
//
// One buffer on each side is enough for the device work to overlap the
// network: the source copies a gathered chunk out of the pinned buffer into
// its gRPC message before it starts the write and gathers the next chunk
// during it; the puller waits only until the previous upload has read the
// pinned buffer (the unpacking reads the device buffer, which the next
// upload, later on the same stream, cannot overtake).
//
// Stagings are kept in a KvSpanStagingPool between pulls: cudaMalloc,
// cudaHostAlloc and stream creation cost milliseconds, and cudaFree waits
// for the whole device, stalling the model's steps.
#ifndef PDWORKER_WORKER_TRANSFER_KV_SPAN_STAGING_H_
#define PDWORKER_WORKER_TRANSFER_KV_SPAN_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/event.h"
#include "worker/runtime/host_memory.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/stream_fence.h"

namespace pdworker {

// Used by one thread at a time (a pull's).
class KvSpanStaging {
 public:
  // Buffers of `capacity_bytes` (> 0) on the device and pinned on the host,
  // and a stream of `device`'s own.
  static absl::StatusOr<std::unique_ptr<KvSpanStaging>> Create(
      Device& device, size_t capacity_bytes);

  size_t capacity_bytes() const { return capacity_bytes_; }

  // Source. Enqueues packing tokens [first_token, first_token + num_tokens)
  // of `seq` and copying them into the host buffer. The host buffer must
  // not be in use (Gathered's bytes copied out). INVALID_ARGUMENT when the
  // span is larger than the capacity or outside `seq`.
  absl::Status Gather(const KvCacheView& view, const SequenceKv& seq,
                      int32_t first_token, int32_t num_tokens);
  // Waits for the last Gather; its view.BytesFor(num_tokens) bytes, valid
  // until the next Gather.
  absl::StatusOr<const char*> Gathered();

  // Puller. Waits until the previous Scatter's upload has read the host
  // buffer, copies `bytes` (== view.BytesFor(num_tokens)) into it and
  // enqueues the upload and the unpacking into `seq`'s blocks. Grows the
  // buffers first when the span does not fit (the source picks the chunk
  // size; gRPC's message size limit bounds it).
  absl::Status Scatter(absl::string_view bytes, const KvCacheView& view,
                       const SequenceKv& seq, int32_t first_token,
                       int32_t num_tokens);

  // Waits for everything enqueued (the last Scatter's blocks are written).
  absl::Status Synchronize() { return stream_->Synchronize(); }

 private:
  KvSpanStaging() = default;
  absl::Status Allocate(size_t capacity_bytes);
  absl::Status WaitForHostBuffer();

  Device* device_ = nullptr;
  std::unique_ptr<Stream> stream_;
  // Recorded after each Gather's download and each Scatter's upload: when
  // the host buffer is free again.
  std::unique_ptr<Event> done_;
  bool recorded_ = false;
  size_t capacity_bytes_ = 0;
  DeviceMemory packed_;
  HostMemory host_;
  // Destroyed before the buffers: queued gathers and scatters have run.
  StreamFence fence_;
};

// Idle stagings of one size, lent to one pull at a time.
class KvSpanStagingPool {
 public:
  // Stagings of the largest span of whole tokens of `view` that fits
  // `max_chunk_bytes` (at least one token). `device` must outlive the
  // pool; at most `max_idle` idle stagings are kept (more may be lent at
  // once; the extra ones are freed when returned).
  KvSpanStagingPool(Device& device, const KvCacheView& view,
                    size_t max_chunk_bytes, int max_idle);

  struct Returner {
    KvSpanStagingPool* pool = nullptr;
    void operator()(KvSpanStaging* staging) const;
  };
  using Lease = std::unique_ptr<KvSpanStaging, Returner>;

  // An idle staging, or a new one (its allocation's error otherwise).
  absl::StatusOr<Lease> Acquire();

  size_t capacity_bytes() const { return capacity_bytes_; }
  // Tokens per span in a staging of capacity_bytes().
  int32_t span_tokens() const { return span_tokens_; }
  int idle() const;

 private:
  void Return(KvSpanStaging* staging);

  Device& device_;
  const int32_t span_tokens_;
  const size_t capacity_bytes_;
  const int max_idle_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<KvSpanStaging>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_KV_SPAN_STAGING_H_
