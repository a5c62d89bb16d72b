// A paged KV cache for transfer tests and fuzzers, in one allocation of a
// device (the CPU backend's memory is host memory, readable directly).
#ifndef PDWORKER_TESTS_TRANSFER_TEST_KV_CACHE_H_
#define PDWORKER_TESTS_TRANSFER_TEST_KV_CACHE_H_

#include <cstddef>
#include <cstring>

#include "worker/runner/kv_cache_view.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_buffer.h"

namespace pdworker::testing {

struct TestKvCache {
  DeviceMemory memory;
  KvCacheView view;
};

// `num_blocks` blocks of `block_size` tokens per layer part, parts laid out
// K0 V0 K1 V1 ..., rows of layout.num_kv_heads * head_dim float32s,
// zero-filled.
inline TestKvCache MakeTestKvCache(Device& device, const KvLayoutInfo& layout,
                                   int block_size, int num_blocks) {
  TestKvCache c;
  const size_t token_bytes = static_cast<size_t>(layout.num_kv_heads) *
                             layout.head_dim * sizeof(float);
  const size_t part =
      static_cast<size_t>(num_blocks) * block_size * token_bytes;
  c.memory = *device.Allocate(part * 2 * layout.num_layers);
  std::memset(c.memory.data(), 0, c.memory.size_bytes());
  c.view.layout = layout;
  c.view.block_size = block_size;
  c.view.token_bytes = token_bytes;
  c.view.allocation = c.memory.buffer();
  for (int l = 0; l < layout.num_layers; ++l) {
    c.view.keys.push_back(c.memory.buffer().Slice(2 * l * part, part));
    c.view.values.push_back(c.memory.buffer().Slice((2 * l + 1) * part, part));
  }
  return c;
}

}  // namespace pdworker::testing

#endif  // PDWORKER_TESTS_TRANSFER_TEST_KV_CACHE_H_
