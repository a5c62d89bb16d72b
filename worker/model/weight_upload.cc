#include "worker/model/weight_upload.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/float16.h"

namespace pdworker {
namespace {

// The CPU backend converts in ops of this many output bytes: large enough
// that the per-op cost vanishes, small enough that a failed load stops soon.
constexpr size_t kCpuUploadChunkBytes = size_t{16} << 20;

// Writes `count` elements of `from` (the mapped tensor bytes, dtype `src`)
// as `dst` elements into `out`. Element by element where the types differ:
// the chunk is a pinned block (16 MiB at most), so no second buffer.
void Convert(DType src, const uint8_t* from, int64_t count, DType dst,
             void* out) {
  if (src == dst) {
    std::memcpy(out, from, static_cast<size_t>(count) * DTypeSize(src));
    return;
  }
  if (dst == DType::kFloat32) {
    ConvertToFloat32(src, from, count, static_cast<float*>(out));
    return;
  }
  // bf16 from f32 or f16.
  auto* bits = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < count; ++i) {
    float value;
    if (src == DType::kFloat32) {
      std::memcpy(&value, from + 4 * i, sizeof(value));
    } else {
      uint16_t half;
      std::memcpy(&half, from + 2 * i, sizeof(half));
      value = Float16BitsToFloat(half);
    }
    bits[i] = FloatToBFloat16Bits(value);
  }
}

}  // namespace

size_t DeviceBytesOf(const TensorInfo& tensor, DType dtype) {
  return static_cast<size_t>(tensor.NumElements()) * DTypeSize(dtype);
}

absl::Status UploadTensor(const TensorInfo& tensor, DType dtype,
                          UploadRing* ring, Stream& stream, DeviceBuffer dst) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("UploadTensor: no weights in ", DTypeName(dtype)));
  }
  if (dst.size_bytes() < DeviceBytesOf(tensor, dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UploadTensor: destination holds ", dst.size_bytes(), " bytes, the ",
        "tensor needs ", DeviceBytesOf(tensor, dtype)));
  }
  const size_t in_size = DTypeSize(tensor.dtype), out_size = DTypeSize(dtype);
  const int64_t count = tensor.NumElements();
  if (ring == nullptr) {
    if (stream.kind() != DeviceKind::kCpu) {
      return absl::InvalidArgumentError(
          "UploadTensor: without an upload ring only on the CPU backend");
    }
    // The CPU device's memory is the host's: the conversion itself is the
    // upload, an op on the stream per chunk from the mapping into `dst` (no
    // staging block, no second copy of every byte). A threaded stream runs
    // it beside the caller's own work (the weights digest).
    const int64_t per_op =
        static_cast<int64_t>(kCpuUploadChunkBytes / out_size);
    for (int64_t begin = 0; begin < count; begin += per_op) {
      const int64_t n = std::min(per_op, count - begin);
      const uint8_t* from = tensor.bytes.data() + begin * in_size;
      void* out = dst.Slice(begin * out_size, n * out_size).data();
      const DType src = tensor.dtype;
      PDW_RETURN_IF_ERROR(stream.Launch(
          "upload_tensor", [src, from, n, dtype, out](const OpContext&) {
            Convert(src, from, n, dtype, out);
          }));
    }
    return absl::OkStatus();
  }
  const int64_t per_chunk =
      static_cast<int64_t>(ring->block_bytes() / out_size);
  if (per_chunk == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("UploadTensor: ring blocks of ", ring->block_bytes(),
                     " bytes hold no ", DTypeName(dtype), " element"));
  }
  for (int64_t begin = 0; begin < count; begin += per_chunk) {
    const int64_t n = std::min(per_chunk, count - begin);
    PDW_ASSIGN_OR_RETURN(void* block, ring->Next());
    Convert(tensor.dtype, tensor.bytes.data() + begin * in_size, n, dtype,
            block);
    PDW_RETURN_IF_ERROR(ring->Upload(
        stream, dst.Slice(begin * out_size, n * out_size), n * out_size));
  }
  return absl::OkStatus();
}

}  // namespace pdworker
