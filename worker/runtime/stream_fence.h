// StreamFence: memory that queued stream work reads or writes is released
// only after that work has run.
#ifndef PDWORKER_WORKER_RUNTIME_STREAM_FENCE_H_
#define PDWORKER_WORKER_RUNTIME_STREAM_FENCE_H_

#include "absl/status/status.h"
#include "worker/runtime/stream.h"

namespace pdworker {

// Work enqueued on a stream runs after the call that enqueued it returned
// (on CUDA and on the threaded CPU stream): a copy into a weights arena, an
// upload out of pinned host memory, a KV write into blocks a pull reserved.
// An owner that frees or hands out such memory on an error path before the
// work ran lets the work write freed memory, or memory someone else owns by
// then. A StreamFence waits for the stream when it is destroyed, so
// declaring it right after the owner (C++ destroys it first) orders the
// release after the work on every exit path:
//
//   LlamaWeights w = ...;            // owns the arena the copies write
//   StreamFence fence(stream);       // destroyed before `w`
//   PDW_RETURN_IF_ERROR(Upload(w));  // an error returns: fence waits first
//   PDW_RETURN_IF_ERROR(fence.Wait());
//
// For memory released by a call rather than a destructor (KV blocks given
// back to a pool), call Wait() before that call. Waiting covers all work
// enqueued on the stream so far (Stream::Synchronize: an in-order stream
// has no cheaper point that is sure to follow the owner's work); on a
// faulted stream it returns at once, since the device runs nothing more.
// Move-only; the stream must outlive the fence.
class StreamFence {
 public:
  // Guards nothing (a member assigned once its stream exists).
  StreamFence() = default;
  explicit StreamFence(Stream& stream) : stream_(&stream) {}
  // Waits for the stream; a failed wait is logged (destructors never fail).
  ~StreamFence();

  StreamFence(StreamFence&& other) noexcept;
  // Waits for the stream this fence guarded first.
  StreamFence& operator=(StreamFence&& other) noexcept;
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;

  // Waits now for everything enqueued so far and returns the stream's
  // error (a faulted device), OK without a stream. The fence keeps guarding
  // work enqueued later. FAILED_PRECONDITION while the stream captures a
  // graph (which that invalidates: memory freed under a capture would leave
  // the graph pointing at it).
  absl::Status Wait();

 private:
  Stream* stream_ = nullptr;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RUNTIME_STREAM_FENCE_H_
