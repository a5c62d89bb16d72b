// Checkpoint tensors into device buffers, converted to the device's dtype,
// in one pass over the mapped file.
//
// The tensor is cut into chunks of the ring's block size; the host converts
// a chunk from the mapping straight into the ring's next pinned block and
// queues its DMA, so the stream copies chunk i while the host converts
// chunk i+1 (UploadRing::Next waits only when every block is still being
// copied). One pass over the weights, no per-tensor host buffer. On the CPU
// backend, whose device memory is host memory, the stream converts each
// chunk from the mapping straight into the destination instead (no ring, one
// copy). bench/load_time_bench times the load against `cat` of the files.
#ifndef PDWORKER_WORKER_MODEL_WEIGHT_UPLOAD_H_
#define PDWORKER_WORKER_MODEL_WEIGHT_UPLOAD_H_

#include <cstddef>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/model/safetensors.h"
#include "worker/runtime/device_buffer.h"
#include "worker/runtime/stream.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {

// Bytes `tensor` takes on the device as `dtype`.
size_t DeviceBytesOf(const TensorInfo& tensor, DType dtype);

// Queues `tensor`'s elements converted to `dtype` (kFloat32, or kBFloat16
// rounded to nearest even from f32/f16, exact from bf16) into `dst`, which
// must hold DeviceBytesOf(tensor, dtype) bytes: through `ring`'s pinned
// blocks, or, with no ring (the CPU backend only), converted by the stream
// straight from the mapping. Returns once the last chunk is queued; `dst`,
// the ring's blocks and (without a ring, where the stream reads it) the
// tensor's mapping are in use until the stream ran the copies, so the
// caller keeps them alive behind a StreamFence. INVALID_ARGUMENT for
// kFloat16, a `dst` too small, or no ring off the CPU backend; the ring's
// and the stream's errors.
absl::Status UploadTensor(const TensorInfo& tensor, DType dtype,
                          UploadRing* ring, Stream& stream, DeviceBuffer dst);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_WEIGHT_UPLOAD_H_
