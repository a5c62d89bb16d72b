// CUDA IPC between two processes on one GPU, as a prefill and a decode
// worker on one host use it: a child process allocates a "KV cache", fills
// it and exports the allocation; this process maps it with CudaIpcMappings,
// reads it back and copies tokens out of it through ViewOfExport +
// CopyKvTokens. Skips without a GPU (the child reports it).
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/device_factory.h"
#include "worker/runtime/stream.h"
#include "worker/transfer/cuda_ipc.h"
#include "worker/transfer/cuda_ipc_puller.h"

namespace pdworker {
namespace {

constexpr size_t kBytes = size_t{1} << 20;

uint8_t PatternAt(size_t i) { return static_cast<uint8_t>(i * 31 + 7); }

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The exporting process: never returns.
[[noreturn]] void RunExporter(int to_parent, int from_parent) {
  auto device = CreateDevice(DeviceKind::kCuda);
  if (!device.ok()) {
    WriteAll(to_parent, "SKIP", 4);
    _exit(0);
  }
  auto memory = (*device)->Allocate(kBytes);
  auto stream = (*device)->CreateStream();
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = PatternAt(i);
  if (!memory.ok() || !stream.ok() ||
      !(*stream)->CopyToDevice(memory->buffer(), pattern.data(), kBytes).ok() ||
      !(*stream)->Synchronize().ok()) {
    WriteAll(to_parent, "FAIL", 4);
    _exit(1);
  }
  absl::StatusOr<std::string> handle = ExportCudaIpcHandle(memory->buffer());
  if (!handle.ok()) {
    WriteAll(to_parent, "FAIL", 4);
    _exit(1);
  }
  const uint32_t size = static_cast<uint32_t>(handle->size());
  WriteAll(to_parent, "OKAY", 4);
  WriteAll(to_parent, &size, sizeof(size));
  WriteAll(to_parent, handle->data(), handle->size());
  char done;
  ReadAll(from_parent, &done, 1);  // keep the memory alive until then
  _exit(0);
}

TEST(CudaIpcGpuTest, MapsAndCopiesAnotherProcessesKvCache) {
  int to_parent[2], from_parent[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(from_parent), 0);
  // Fork before this process touches CUDA (a CUDA context does not survive
  // fork).
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Keep only this side's ends: the child must see EOF on from_parent
    // when the parent exits early (a failed ASSERT), or it would block
    // forever holding the test's stdout and its CUDA context.
    close(to_parent[0]);
    close(from_parent[1]);
    RunExporter(to_parent[1], from_parent[0]);
  }
  // Likewise, a child that crashes before writing must give the parent EOF
  // instead of a hang. (The parent keeps its read end of from_parent: the
  // final write must not raise SIGPIPE after the child has exited.)
  close(to_parent[1]);

  char tag[4];
  ASSERT_TRUE(ReadAll(to_parent[0], tag, 4));
  const std::string status(tag, 4);
  auto finish_child = [&] {
    WriteAll(from_parent[1], "x", 1);
    int wstatus = 0;
    waitpid(child, &wstatus, 0);
  };
  if (status == "SKIP") {
    finish_child();
    GTEST_SKIP() << "no usable GPU";
  }
  ASSERT_EQ(status, "OKAY") << "the exporting process failed";
  uint32_t size = 0;
  ASSERT_TRUE(ReadAll(to_parent[0], &size, sizeof(size)));
  std::string handle(size, '\0');
  ASSERT_TRUE(ReadAll(to_parent[0], handle.data(), size));

  auto device = CreateDevice(DeviceKind::kCuda);
  ASSERT_TRUE(device.ok()) << device.status();
  auto stream = (*device)->CreateStream();
  ASSERT_TRUE(stream.ok());
  {
    CudaIpcMappings mappings;
    absl::StatusOr<DeviceBuffer> mapped = mappings.Open(handle, kBytes);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    // Opening again reuses the mapping.
    absl::StatusOr<DeviceBuffer> again = mappings.Open(handle, kBytes);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->data(), mapped->data());

    std::vector<uint8_t> read(kBytes);
    ASSERT_TRUE((*stream)->CopyToHost(read.data(), *mapped, kBytes).ok());
    for (size_t i = 0; i < kBytes; i += 4099) {
      ASSERT_EQ(read[i], PatternAt(i)) << i;
    }

    // As a KV cache: 2 layers x (K, V) of 8 blocks x 16 tokens x 1 KiB.
    constexpr size_t kTokenBytes = 1024;
    constexpr int kBlock = 16;
    const int64_t per_layer = 8 * kBlock * kTokenBytes;  // 128 KiB
    v1::CudaIpcExport e;
    e.set_mem_handle(handle);
    e.set_allocation_bytes(kBytes);
    for (int l = 0; l < 2; ++l) {
      e.add_key_offsets(2 * l * per_layer);
      e.add_value_offsets((2 * l + 1) * per_layer);
    }
    e.set_cache_bytes_per_layer(per_layer);
    e.set_block_size(kBlock);
    for (int32_t b : {5, 2}) e.add_blocks(b);
    e.set_num_tokens(20);
    auto local = (*device)->Allocate(4 * per_layer);
    ASSERT_TRUE(local.ok());
    KvCacheView ours;
    ours.layout = {2, 4, 128, "bfloat16"};
    ours.block_size = kBlock;
    ours.token_bytes = kTokenBytes;
    ours.allocation = local->buffer();
    for (int l = 0; l < 2; ++l) {
      ours.keys.push_back(local->buffer().Slice(2 * l * per_layer, per_layer));
      ours.values.push_back(
          local->buffer().Slice((2 * l + 1) * per_layer, per_layer));
    }
    absl::StatusOr<KvCacheView> source = ViewOfExport(e, *mapped, ours, 20);
    ASSERT_TRUE(source.ok()) << source.status();
    SequenceKv from, to;
    from.blocks = {5, 2};
    from.num_tokens = 20;
    to.blocks = {0, 7};
    to.num_tokens = 20;
    ASSERT_TRUE(CopyKvTokens(**stream, *source, from, ours, to, 20).ok());
    // Token 17 of layer 1's V: source block 2, slot 1; ours block 7, slot 1.
    std::vector<uint8_t> token(kTokenBytes);
    ASSERT_TRUE(
        (*stream)
            ->CopyToHost(token.data(),
                         ours.values[1].Slice((7 * kBlock + 1) * kTokenBytes,
                                              kTokenBytes),
                         kTokenBytes)
            .ok());
    const size_t source_offset = 3 * per_layer + (2 * kBlock + 1) * kTokenBytes;
    for (size_t i = 0; i < kTokenBytes; ++i) {
      ASSERT_EQ(token[i], PatternAt(source_offset + i)) << i;
    }
  }
  finish_child();
}

}  // namespace
}  // namespace pdworker
