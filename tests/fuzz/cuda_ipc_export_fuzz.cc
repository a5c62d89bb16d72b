// Fuzz target: the CUDA IPC export record a prefill worker sends a decode
// worker on the same host (v1::CudaIpcExport: where the lease's KV lives in
// the source's mapped allocation). The decode worker turns it into a view
// of that memory (ViewOfExport) and then copies the lease's blocks out of
// it: whatever the record says, it is refused with INVALID_ARGUMENT, or
// every byte of every block of the lease, in every layer's K and V, lies
// inside the mapped allocation. (The mapping itself needs a GPU; the
// address here is a placeholder that is never dereferenced.)
#include <cstddef>
#include <cstdint>

#include "glog/logging.h"
#include "proto/worker.pb.h"
#include "worker/runner/kv_cache_view.h"
#include "worker/transfer/cuda_ipc_puller.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdworker;
  if (size < 1) return 0;
  // First byte: the handle's num_tokens (the importer checked it against
  // max_model_len = 128 before); the rest: the record.
  const int32_t num_tokens = data[0] % 128 + 1;
  v1::CudaIpcExport record;
  if (!record.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;

  // Ours: 2 layers, 2 KV heads of 8 float32 (64 bytes per token row).
  KvCacheView ours;
  ours.layout = {2, 2, 8, "float32"};
  ours.block_size = 4;
  ours.token_bytes = 64;
  if (record.allocation_bytes() < 0) return 0;  // as mappings.Open refuses
  const uintptr_t base = uintptr_t{1} << 40;
  const size_t allocation = static_cast<size_t>(record.allocation_bytes());
  if (allocation > (uintptr_t{1} << 62)) return 0;  // no such GPU
  const DeviceBuffer mapped(reinterpret_cast<void*>(base), allocation);

  auto view = ViewOfExport(record, mapped, ours, num_tokens);
  if (!view.ok()) {
    CHECK(view.status().code() == absl::StatusCode::kInvalidArgument)
        << view.status();
    return 0;
  }
  CHECK_EQ(view->layout.num_layers, ours.layout.num_layers);
  CHECK_GT(view->block_size, 0);
  const int32_t blocks_needed =
      (num_tokens + view->block_size - 1) / view->block_size;
  CHECK_EQ(record.blocks_size(), blocks_needed);
  const size_t block_bytes =
      static_cast<size_t>(view->block_size) * view->token_bytes;
  for (int l = 0; l < view->layout.num_layers; ++l) {
    for (const DeviceBuffer& part : {view->keys[l], view->values[l]}) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(part.data());
      CHECK_GE(begin, base);
      CHECK_LE(begin - base + part.size_bytes(), allocation);
      for (const int32_t b : record.blocks()) {
        CHECK_GE(b, 0);
        CHECK_LE((static_cast<size_t>(b) + 1) * block_bytes, part.size_bytes())
            << "block " << b << " of layer " << l << " outside its part";
      }
    }
  }
  return 0;
}
