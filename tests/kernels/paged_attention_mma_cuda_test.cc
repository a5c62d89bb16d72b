// The tensor-core varlen attention kernels (paged_attention_mma.cu, and on
// compute capability 9.0 devices paged_attention_wgmma.cu) against
// the CPU kernel (moderate shapes, every output row), and on prompts of up
// to 8,191 tokens against the CUDA-core kernel (every row) and a float64
// host reference (sampled rows): prompt lengths that are not multiples of
// the 64-row tile, mixed batches with decode rows, cached prefixes (query
// chunks that start mid-sequence), GQA groups 1, 3, 4 and 8, head dims 64
// and 128, block tables in random order. Outputs are poisoned (NaN) before
// every run; rows no request owns must come back as exact zeros.
//
// Tolerance. Inputs are bf16-representable values in [-1, 1]; outputs are
// convex combinations of V rows. The kernel multiplies Q·Kᵀ exactly (bf16
// products, fp32 sums), rounds each softmax weight p to bf16 before P·V
// (relative 2^-9: at most 2^-9 · max|v| on the output) and the output to
// bf16 (2^-9 · |o|). Against fp32 / float64 references: 2^-8 · |want| +
// 2^-8. Against the CUDA-core kernel, which rounds its own output too:
// 2^-7 · |want| + 2^-8. A masking or indexing bug moves outputs by O(0.1);
// reading a position a request does not own reads NaN or the junk block's
// values (50-60).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/paged_attention.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::SameBits;

constexpr double kTol = 1.0 / 256;
constexpr double kRelVsCudaCores = 1.0 / 128;
constexpr int32_t kJunkBlock = 0;

struct Shape {
  int heads;
  int kv_heads;
  int head_dim;
  int block_size;
};

std::string ShapeName(const Shape& s) {
  return absl::StrCat("h", s.heads, "_kv", s.kv_heads, "_d", s.head_dim, "_bs",
                      s.block_size);
}

struct Request {
  int q_len;
  int seq_len;  // context including this step's q_len tokens
};

// One step's inputs on the host (bf16-representable floats).
struct HostStep {
  std::vector<Request> requests;
  int num_tokens = 0;
  std::vector<float> query;  // [num_tokens, query_row_stride]
  std::vector<float> key_cache, value_cache;
  std::vector<int32_t> seq_lens, query_start_loc, block_tables;
};

// One tensor-core kernel configuration under test.
struct Variant {
  VarlenAttentionKernel kernel;
  int warp_rows;  // mma.sync: query rows per warp (0: the default)
  int tile_keys;  // wgmma: key positions per K/V tile (0: the default)
  std::string name;
  WgmmaSchedule schedule = WgmmaSchedule::kDefault;  // wgmma
};

// Buffers of one backend, sized for the largest step a test writes.
struct Buffers {
  PagedAttentionParams params;    // shape fields filled per step
  DeviceBuffer reference_output;  // GPU: the CUDA-core kernel's output
};

class PagedAttentionMmaTest : public CudaKernelTest {
 protected:
  // Capacity of the buffers Allocate makes.
  struct Capacity {
    int tokens;
    int seqs;
    int row_elements;  // query_row_stride
    int max_blocks_per_seq;
    size_t cache_elements;  // per cache (K or V)
  };

  Buffers Allocate(testing::Backend& b, DType dtype, const Capacity& c) {
    const size_t e = DTypeSize(dtype);
    Buffers out;
    PagedAttentionParams& p = out.params;
    p.num_reqs = b.Alloc(sizeof(int32_t));
    p.query_start_loc = b.Alloc(sizeof(int32_t) * (c.seqs + 1));
    p.seq_lens = b.Alloc(sizeof(int32_t) * c.seqs);
    p.block_tables = b.Alloc(sizeof(int32_t) * c.seqs * c.max_blocks_per_seq);
    p.query = b.Alloc(e * c.tokens * c.row_elements);
    p.key_cache = b.Alloc(e * c.cache_elements);
    p.value_cache = b.Alloc(e * c.cache_elements);
    p.output = b.Alloc(e * c.tokens * c.row_elements);
    if (dtype == DType::kBFloat16) {
      out.reference_output = b.Alloc(e * c.tokens * c.row_elements);
    }
    p.max_num_seqs = c.seqs;
    p.max_blocks_per_seq = c.max_blocks_per_seq;
    p.dtype = dtype;
    return out;
  }

  // Random inputs for `requests` (seeded): blocks in random order, unused
  // cache positions NaN, unused table entries the junk block. `bad_block`:
  // the first request's second table entry points past the cache (the
  // kernels skip that block's keys).
  HostStep MakeStep(const Shape& s, const std::vector<Request>& requests,
                    int num_tokens, int max_seqs, int max_blocks_per_seq,
                    int num_blocks, int query_row_stride, uint32_t seed,
                    bool bad_block = false) {
    HostStep h;
    h.requests = requests;
    h.num_tokens = num_tokens;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const size_t kv_width = static_cast<size_t>(s.kv_heads) * s.head_dim;
    const size_t cache =
        static_cast<size_t>(num_blocks) * s.block_size * kv_width;
    h.key_cache.assign(cache, std::numeric_limits<float>::quiet_NaN());
    h.value_cache = h.key_cache;
    for (size_t i = 0; i < s.block_size * kv_width; ++i) {
      h.key_cache[i] = 50.0f + (i % 7);
      h.value_cache[i] = 60.0f - (i % 5);
    }
    std::vector<int32_t> free_blocks(num_blocks - 1);
    std::iota(free_blocks.begin(), free_blocks.end(), 1);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
    size_t next = 0;
    h.seq_lens.assign(max_seqs, 0);
    h.query_start_loc.assign(max_seqs + 1, 0);
    h.block_tables.assign(static_cast<size_t>(max_seqs) * max_blocks_per_seq,
                          kJunkBlock);
    int tokens = 0;
    for (size_t r = 0; r < requests.size(); ++r) {
      h.seq_lens[r] = requests[r].seq_len;
      h.query_start_loc[r] = tokens;
      tokens += requests[r].q_len;
      const int blocks =
          (requests[r].seq_len + s.block_size - 1) / s.block_size;
      for (int b = 0; b < blocks; ++b) {
        const int32_t block = free_blocks.at(next++);
        h.block_tables[r * max_blocks_per_seq + b] = block;
        const int valid =
            std::min(s.block_size, requests[r].seq_len - b * s.block_size);
        for (size_t i = 0; i < valid * kv_width; ++i) {
          const size_t at =
              static_cast<size_t>(block) * s.block_size * kv_width + i;
          h.key_cache[at] = dist(rng);
          h.value_cache[at] = dist(rng);
        }
      }
    }
    if (bad_block) h.block_tables[1] = num_blocks + 3;
    for (size_t r = requests.size(); r <= static_cast<size_t>(max_seqs); ++r) {
      h.query_start_loc[r] = tokens;
    }
    EXPECT_LE(tokens, num_tokens);
    h.query.resize(static_cast<size_t>(num_tokens) * query_row_stride);
    for (float& v : h.query) v = dist(rng);
    h.query = testing::RoundToBf16(h.query);
    h.key_cache = testing::RoundToBf16(h.key_cache);
    h.value_cache = testing::RoundToBf16(h.value_cache);
    return h;
  }

  // Writes `h` into `b` and fills the params' shape fields.
  void Write(testing::Backend& b, Buffers& buffers, const Shape& s,
             const HostStep& h, int num_blocks, int query_row_stride,
             bool bf16) {
    PagedAttentionParams& p = buffers.params;
    p.num_tokens = h.num_tokens;
    p.num_heads = s.heads;
    p.num_kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    p.block_size = s.block_size;
    p.num_blocks = num_blocks;
    p.query_row_stride = query_row_stride;
    b.Write(p.num_reqs,
            std::vector<int32_t>{static_cast<int32_t>(h.requests.size())});
    b.Write(p.query_start_loc, h.query_start_loc);
    b.Write(p.seq_lens, h.seq_lens);
    b.Write(p.block_tables, h.block_tables);
    const size_t out_elements =
        static_cast<size_t>(h.num_tokens) * s.heads * s.head_dim;
    if (bf16) {
      b.Write(p.query, testing::ToBf16Bits(h.query));
      b.Write(p.key_cache, testing::ToBf16Bits(h.key_cache));
      b.Write(p.value_cache, testing::ToBf16Bits(h.value_cache));
      Poison(b, p.output, out_elements);
      Poison(b, buffers.reference_output, out_elements);
    } else {
      b.Write(p.query, h.query);
      b.Write(p.key_cache, h.key_cache);
      b.Write(p.value_cache, h.value_cache);
      b.Write(p.output,
              std::vector<float>(out_elements,
                                 std::numeric_limits<float>::quiet_NaN()));
    }
  }

  static void Poison(testing::Backend& b, DeviceBuffer buffer, size_t n) {
    b.Write(buffer, std::vector<uint16_t>(n, uint16_t{0xFFFF}));  // bf16 NaN
  }

  absl::Status RunGpu(Buffers& buffers, const Variant& variant,
                      DeviceBuffer output) {
    PagedAttentionParams p = buffers.params;
    p.varlen_kernel = variant.kernel;
    p.mma_warp_rows = variant.warp_rows;
    p.wgmma_tile_keys = variant.tile_keys;
    p.wgmma_schedule = variant.schedule;
    p.output = output;
    return LaunchPagedAttention(*gpu().stream, p);
  }
  absl::Status RunGpu(Buffers& buffers, VarlenAttentionKernel kernel,
                      DeviceBuffer output) {
    return RunGpu(buffers, Variant{kernel, 0, 0, ""}, output);
  }

  std::vector<float> ReadGpu(DeviceBuffer output, const Shape& s,
                             int num_tokens) {
    return ReadGpuBf16(output,
                       static_cast<size_t>(num_tokens) * s.heads * s.head_dim);
  }

  // The tensor-core kernels under test: the mma.sync kernel at both tile
  // heights (16 and 32 query rows per warp) and, on a compute capability
  // 9.0 device, the warpgroup-MMA kernel at both key tile widths, serial
  // and overlapped.
  std::vector<Variant> Variants() {
    std::vector<Variant> out = {
        {VarlenAttentionKernel::kTensorCores, 16, 0, "mma.sync 16 rows/warp"},
        {VarlenAttentionKernel::kTensorCores, 32, 0, "mma.sync 32 rows/warp"}};
    if (PagedAttentionHasWarpgroupMma(gpu().stream->kind())) {
      for (const int keys : {64, 128}) {
        for (const WgmmaSchedule schedule :
             {WgmmaSchedule::kSerial, WgmmaSchedule::kOverlapped}) {
          out.push_back(
              {VarlenAttentionKernel::kWarpgroupMma, 0, keys,
               absl::StrCat("wgmma ", keys, "-key tiles, ",
                            schedule == WgmmaSchedule::kSerial ? "serial"
                                                               : "overlapped"),
               schedule});
        }
      }
    } else if (!wgmma_noted_) {
      std::printf(
          "note: the warpgroup-MMA kernel is not run here (the "
          "device is not compute capability 9.0)\n");
      wgmma_noted_ = true;
    }
    return out;
  }

  bool wgmma_noted_ = false;

  static int RealTokens(const HostStep& h) {
    int tokens = 0;
    for (const Request& r : h.requests) tokens += r.q_len;
    return tokens;
  }

  // Rows [RealTokens, num_tokens) must be exactly zero.
  static void ExpectPaddingZero(const std::vector<float>& got, const Shape& s,
                                const HostStep& h, const std::string& what) {
    const size_t width = static_cast<size_t>(s.heads) * s.head_dim;
    for (size_t i = RealTokens(h) * width; i < got.size(); ++i) {
      ASSERT_EQ(got[i], 0.0f) << what << ": padding element " << i;
    }
  }

  // float64 attention of token row `row` (all heads) from the host inputs,
  // skipping blocks outside the cache as the kernels do.
  static std::vector<double> Reference(const Shape& s, const HostStep& h,
                                       int num_blocks, int max_blocks_per_seq,
                                       int query_row_stride, int row) {
    int request = 0, begin = 0;
    while (begin + h.requests[request].q_len <= row) {
      begin += h.requests[request].q_len;
      ++request;
    }
    const Request& r = h.requests[request];
    const int position = r.seq_len - r.q_len + (row - begin);
    const int group = s.heads / s.kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    std::vector<double> out(static_cast<size_t>(s.heads) * s.head_dim, 0.0);
    for (int head = 0; head < s.heads; ++head) {
      const int kv = head / group;
      const float* q = &h.query[static_cast<size_t>(row) * query_row_stride +
                                static_cast<size_t>(head) * s.head_dim];
      std::vector<double> scores;
      std::vector<const float*> values;
      for (int key = 0; key <= position; ++key) {
        const int32_t block =
            h.block_tables[request * max_blocks_per_seq + key / s.block_size];
        if (block < 0 || block >= num_blocks) continue;
        const size_t at =
            ((static_cast<size_t>(block) * s.block_size + key % s.block_size) *
                 s.kv_heads +
             kv) *
            s.head_dim;
        double dot = 0;
        for (int d = 0; d < s.head_dim; ++d) {
          dot += static_cast<double>(q[d]) * h.key_cache[at + d];
        }
        scores.push_back(dot * scale);
        values.push_back(&h.value_cache[at]);
      }
      if (scores.empty()) continue;
      const double max = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (size_t k = 0; k < scores.size(); ++k) {
        for (int d = 0; d < s.head_dim; ++d) {
          out[static_cast<size_t>(head) * s.head_dim + d] +=
              scores[k] / sum * values[k][d];
        }
      }
    }
    return out;
  }
};

// The shapes the tensor-core kernel covers: GQA groups 1, 3 (64 / 3 leaves
// an idle row per tile), 4 and 8, head dims 64 and 128, block sizes 8-32.
const Shape kShapes[] = {
    {2, 2, 64, 16},  {6, 2, 64, 8},   {4, 1, 64, 32}, {8, 1, 64, 16},
    {2, 2, 128, 16}, {6, 2, 128, 16}, {4, 1, 128, 8}, {8, 1, 128, 32},
};

// Random mixed batches (fresh prompts, prompts continuing a cached prefix,
// decode rows) vs the CPU kernel, every row.
TEST_F(PagedAttentionMmaTest, RandomBatchesMatchTheCpuKernel) {
  constexpr int kSeqs = 6, kMaxQ = 160, kMaxPrefix = 260, kMaxPadding = 20;
  constexpr int kMinBlock = 8;
  const int max_context = kMaxQ + kMaxPrefix;
  const int max_blocks = (max_context + kMinBlock - 1) / kMinBlock;
  // Per shape: n · ceil(max_context / block_size) + 1 blocks of block_size
  // positions, kv_heads · head_dim <= 2 · 128 wide.
  const Capacity capacity{
      kSeqs * kMaxQ + kMaxPadding, kSeqs, 8 * 128, max_blocks,
      static_cast<size_t>(kSeqs * (max_context + 32) + 32) * 2 * 128};
  Buffers on_cpu = Allocate(cpu(), DType::kFloat32, capacity);
  Buffers on_gpu = Allocate(gpu(), DType::kBFloat16, capacity);
  std::mt19937 rng(2211);
  int trial = 0;
  for (const Shape& s : kShapes) {
    for (int round = 0; round < 2; ++round, ++trial) {
      std::vector<Request> requests;
      const int n = 1 + rng() % kSeqs;
      int tokens = 0;
      for (int r = 0; r < n; ++r) {
        // Lengths around the tile edges too (63, 64, 65 rows of G = 1).
        static const int kEdges[] = {1, 15, 16, 17, 21, 63, 64, 65, 129};
        const int q_len = rng() % 3 == 0 ? kEdges[rng() % 9]
                                         : 1 + static_cast<int>(rng() % kMaxQ);
        const int prefix =
            rng() % 3 == 0 ? 0 : static_cast<int>(rng() % kMaxPrefix);
        requests.push_back({q_len, prefix + q_len});
        tokens += q_len;
      }
      const int num_tokens = tokens + static_cast<int>(rng() % kMaxPadding);
      const int stride = s.heads * s.head_dim;
      const int num_blocks =
          n * ((max_context + s.block_size - 1) / s.block_size) + 1;
      const int blocks_per_seq =
          (max_context + s.block_size - 1) / s.block_size;
      const HostStep h =
          MakeStep(s, requests, num_tokens, kSeqs, blocks_per_seq, num_blocks,
                   stride, 5000 + trial);
      on_cpu.params.max_blocks_per_seq = blocks_per_seq;
      on_gpu.params.max_blocks_per_seq = blocks_per_seq;
      Write(cpu(), on_cpu, s, h, num_blocks, stride, /*bf16=*/false);
      Write(gpu(), on_gpu, s, h, num_blocks, stride, /*bf16=*/true);
      ASSERT_TRUE(LaunchPagedAttention(*cpu().stream, on_cpu.params).ok());
      const std::vector<float> want = cpu().Read<float>(
          on_cpu.params.output,
          static_cast<size_t>(num_tokens) * s.heads * s.head_dim);
      for (const Variant& variant : Variants()) {
        Poison(gpu(), on_gpu.params.output,
               static_cast<size_t>(num_tokens) * s.heads * s.head_dim);
        const absl::Status status =
            RunGpu(on_gpu, variant, on_gpu.params.output);
        ASSERT_TRUE(status.ok()) << status;
        const std::vector<float> got =
            ReadGpu(on_gpu.params.output, s, num_tokens);
        const std::string what =
            absl::StrCat(ShapeName(s), " ", variant.name, " trial ", trial,
                         " (", n, " requests, ", num_tokens, " rows)");
        ExpectClose(got, want, kTol, kTol, what);
        ExpectPaddingZero(got, s, h, what);
      }
    }
  }
}

// Prompts of up to 8,191 tokens, one of them continuing a 1,096-token cached
// prefix, plus a decode row at 5,000: every row against the CUDA-core
// kernel, sampled rows (each request's first and last, tile edges, random
// ones) against float64. Query rows are slices of a fused QKV row.
TEST_F(PagedAttentionMmaTest, LongPromptsMatchCudaCoresAndFloat64) {
  const std::vector<Request> requests = {
      {8191, 8191}, {3001, 4097}, {1, 5000}, {777, 777}};
  constexpr int kPadding = 30, kSeqs = 4, kBlockSize = 16;
  int tokens = 0, context = 0;
  for (const Request& r : requests) {
    tokens += r.q_len;
    context = std::max(context, r.seq_len);
  }
  const int num_tokens = tokens + kPadding;
  const int blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  const int num_blocks = kSeqs * blocks_per_seq + 1;
  const Shape shapes[] = {
      {8, 2, 128, kBlockSize}, {8, 1, 64, kBlockSize}, {4, 4, 64, kBlockSize}};
  // Fused QKV rows: (heads + 2 · kv_heads) · head_dim wide.
  const Capacity capacity{
      num_tokens, kSeqs, (8 + 2 * 4) * 128, blocks_per_seq,
      static_cast<size_t>(num_blocks) * kBlockSize * 4 * 64};
  Buffers on_gpu = Allocate(gpu(), DType::kBFloat16, capacity);
  on_gpu.params.max_blocks_per_seq = blocks_per_seq;
  for (const Shape& s : shapes) {
    ASSERT_LE(
        static_cast<size_t>(num_blocks) * kBlockSize * s.kv_heads * s.head_dim,
        capacity.cache_elements);
    const int stride = (s.heads + 2 * s.kv_heads) * s.head_dim;
    const HostStep h = MakeStep(s, requests, num_tokens, kSeqs, blocks_per_seq,
                                num_blocks, stride, 77 + s.head_dim + s.heads);
    Write(gpu(), on_gpu, s, h, num_blocks, stride, /*bf16=*/true);
    absl::Status status = RunGpu(on_gpu, VarlenAttentionKernel::kCudaCores,
                                 on_gpu.reference_output);
    ASSERT_TRUE(status.ok()) << status;
    const std::vector<float> cuda_cores =
        ReadGpu(on_gpu.reference_output, s, num_tokens);
    // float64 at sampled rows: each request's first and last, tile edges,
    // random ones.
    std::vector<int> rows;
    int begin = 0;
    for (const Request& r : requests) {
      rows.push_back(begin);
      rows.push_back(begin + r.q_len - 1);
      begin += r.q_len;
    }
    for (int edge : {63, 64, 65, 127, 128, 4095, 4096, 8190})
      rows.push_back(edge);
    std::mt19937 rng(s.head_dim);
    for (int i = 0; i < 16; ++i) rows.push_back(rng() % tokens);
    const size_t width = static_cast<size_t>(s.heads) * s.head_dim;
    std::vector<float> want_rows;
    for (int row : rows) {
      const std::vector<double> want =
          Reference(s, h, num_blocks, blocks_per_seq, stride, row);
      for (size_t i = 0; i < width; ++i) {
        want_rows.push_back(static_cast<float>(want[i]));
      }
    }

    for (const Variant& variant : Variants()) {
      Poison(gpu(), on_gpu.params.output,
             static_cast<size_t>(num_tokens) * s.heads * s.head_dim);
      status = RunGpu(on_gpu, variant, on_gpu.params.output);
      ASSERT_TRUE(status.ok()) << status;
      const std::vector<float> got =
          ReadGpu(on_gpu.params.output, s, num_tokens);
      const std::string what = absl::StrCat(ShapeName(s), " ", variant.name);
      ExpectClose(got, cuda_cores, kRelVsCudaCores, kTol,
                  what + " vs the CUDA-core kernel");
      ExpectPaddingZero(got, s, h, what);
      std::vector<float> got_rows;
      for (int row : rows) {
        got_rows.insert(got_rows.end(), got.begin() + row * width,
                        got.begin() + (row + 1) * width);
      }
      ExpectClose(got_rows, want_rows, kTol, kTol, what + " vs float64");
    }
  }
}

// A block id outside the cache (a corrupt table) is skipped, as the CPU
// kernel skips it, in every tile (the kernel's masked path).
TEST_F(PagedAttentionMmaTest, BlockIdsOutsideTheCacheAreSkippedAsOnCpu) {
  const Shape s{8, 2, 64, 16};
  const std::vector<Request> requests = {{200, 300}, {70, 70}};
  constexpr int kSeqs = 2, kBlocksPerSeq = 20, kNumTokens = 280;
  const int num_blocks = kSeqs * kBlocksPerSeq + 1;
  const int stride = s.heads * s.head_dim;
  const Capacity capacity{kNumTokens, kSeqs, stride, kBlocksPerSeq,
                          static_cast<size_t>(num_blocks) * 16 * 2 * 64};
  Buffers on_cpu = Allocate(cpu(), DType::kFloat32, capacity);
  Buffers on_gpu = Allocate(gpu(), DType::kBFloat16, capacity);
  const HostStep h = MakeStep(s, requests, kNumTokens, kSeqs, kBlocksPerSeq,
                              num_blocks, stride, 31, /*bad_block=*/true);
  Write(cpu(), on_cpu, s, h, num_blocks, stride, false);
  Write(gpu(), on_gpu, s, h, num_blocks, stride, true);
  ASSERT_TRUE(LaunchPagedAttention(*cpu().stream, on_cpu.params).ok());
  const std::vector<float> want = cpu().Read<float>(
      on_cpu.params.output, static_cast<size_t>(kNumTokens) * stride);
  for (const Variant& variant : Variants()) {
    Poison(gpu(), on_gpu.params.output,
           static_cast<size_t>(kNumTokens) * stride);
    ASSERT_TRUE(RunGpu(on_gpu, variant, on_gpu.params.output).ok());
    ExpectClose(ReadGpu(on_gpu.params.output, s, kNumTokens), want, kTol, kTol,
                "bad block id, " + variant.name);
  }
}

// A graph captured on one batch and replayed after another batch of the
// same padded size was written gives the bits of an eager launch on it.
TEST_F(PagedAttentionMmaTest, GraphReplayIsBitIdenticalToEager) {
  const Shape s{32, 8, 64, 16};  // Llama-3.2-1B
  constexpr int kSeqs = 8, kBlocksPerSeq = 64, kNumTokens = 600;
  const int num_blocks = kSeqs * kBlocksPerSeq + 1;
  const int stride = s.heads * s.head_dim;
  const Capacity capacity{kNumTokens, kSeqs, stride, kBlocksPerSeq,
                          static_cast<size_t>(num_blocks) * 16 * 8 * 64};
  Buffers on_cpu = Allocate(cpu(), DType::kFloat32, capacity);
  Buffers on_gpu = Allocate(gpu(), DType::kBFloat16, capacity);
  const HostStep first = MakeStep(s, {{500, 500}, {90, 700}}, kNumTokens, kSeqs,
                                  kBlocksPerSeq, num_blocks, stride, 1);
  // More requests, other lengths and prefixes, other blocks.
  const HostStep next =
      MakeStep(s, {{1, 1000}, {333, 333}, {17, 17}, {200, 650}, {1, 5}},
               kNumTokens, kSeqs, kBlocksPerSeq, num_blocks, stride, 2);
  Write(cpu(), on_cpu, s, next, num_blocks, stride, false);
  ASSERT_TRUE(LaunchPagedAttention(*cpu().stream, on_cpu.params).ok());
  const std::vector<float> want = cpu().Read<float>(
      on_cpu.params.output, static_cast<size_t>(kNumTokens) * stride);
  Stream& stream = *gpu().stream;
  for (const Variant& variant : Variants()) {
    Write(gpu(), on_gpu, s, first, num_blocks, stride, true);
    ASSERT_TRUE(RunGpu(on_gpu, variant, on_gpu.params.output).ok());  // warm-up
    ASSERT_TRUE(stream.BeginCapture().ok());
    ASSERT_TRUE(RunGpu(on_gpu, variant, on_gpu.params.output).ok());
    auto graph = stream.EndCapture();
    ASSERT_TRUE(graph.ok()) << graph.status();

    Write(gpu(), on_gpu, s, next, num_blocks, stride, true);
    ASSERT_TRUE((*graph)->Replay().ok());
    const std::vector<float> replayed =
        ReadGpu(on_gpu.params.output, s, kNumTokens);
    ExpectClose(replayed, want, kTol, kTol, "replay vs cpu, " + variant.name);
    Write(gpu(), on_gpu, s, next, num_blocks, stride, true);  // NaN outputs
    ASSERT_TRUE(RunGpu(on_gpu, variant, on_gpu.params.output).ok());
    EXPECT_TRUE(
        SameBits(ReadGpu(on_gpu.params.output, s, kNumTokens), replayed))
        << variant.name;
  }
}

// kTensorCores and kWarpgroupMma on a head_dim they do not cover are refused
// before anything runs: the output keeps its poison.
TEST_F(PagedAttentionMmaTest, TensorCoresRefuseUncoveredShapes) {
  const Shape s{4, 1, 96, 16};
  constexpr int kNumTokens = 8;
  const int stride = s.heads * s.head_dim;
  const Capacity capacity{kNumTokens, 1, stride, 4, 5 * 16 * 96};
  Buffers on_gpu = Allocate(gpu(), DType::kBFloat16, capacity);
  const HostStep h = MakeStep(s, {{8, 8}}, kNumTokens, 1, 4, 5, stride, 3);
  Write(gpu(), on_gpu, s, h, 5, stride, true);
  const absl::Status status =
      RunGpu(on_gpu, VarlenAttentionKernel::kTensorCores, on_gpu.params.output);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("head_dim 96"), std::string::npos) << status;
  for (float v : ReadGpu(on_gpu.params.output, s, kNumTokens)) {
    ASSERT_TRUE(std::isnan(v));
  }
  // So is kWarpgroupMma, on any device (it covers the same head dims).
  const absl::Status wgmma = RunGpu(
      on_gpu, VarlenAttentionKernel::kWarpgroupMma, on_gpu.params.output);
  EXPECT_EQ(wgmma.code(), absl::StatusCode::kInvalidArgument) << wgmma;
  EXPECT_NE(wgmma.message().find("head_dim 96"), std::string::npos) << wgmma;
  for (float v : ReadGpu(on_gpu.params.output, s, kNumTokens)) {
    ASSERT_TRUE(std::isnan(v));
  }
  // kAuto runs the CUDA-core kernel for it.
  EXPECT_TRUE(
      RunGpu(on_gpu, VarlenAttentionKernel::kAuto, on_gpu.params.output).ok());
  for (float v : ReadGpu(on_gpu.params.output, s, kNumTokens)) {
    ASSERT_FALSE(std::isnan(v));
  }
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
