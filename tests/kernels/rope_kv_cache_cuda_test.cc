// rope_kv_cache on CUDA vs the CPU kernel, and the KV write/read round trip.
//
// Tolerance of the rotated q/k: the angle is the same fp32 product on both
// backends; cos/sin differ by ~1 ulp (CUDA sincosf vs glibc), and the GPU
// rounds the result to bf16 (<= 2^-9 relative): 2^-8 · |cpu| + 1e-5.
// The cache must hold exactly the GPU's rotated k and its v (bit for bit),
// and nothing else may change.
#include <cstdint>
#include <vector>

#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/rope_kv_cache.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::ExpectClose;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 10;
constexpr uint16_t kPoison = 0xFFFF;  // bf16 NaN, what Alloc fills with

struct RopeCase {
  int heads;
  int kv_heads;
  int head_dim;
};

class RopeKvCacheCudaTest : public CudaKernelTest,
                            public ::testing::WithParamInterface<RopeCase> {
 protected:
  // Params over a fused qkv buffer [tokens, (H + 2·KV)·D] on `b`.
  RopeKvCacheParams Params(DeviceBuffer qkv, DeviceBuffer positions,
                           DeviceBuffer slots, DeviceBuffer inv_freq,
                           DeviceBuffer key_cache, DeviceBuffer value_cache,
                           int tokens, DType dtype) const {
    const RopeCase c = GetParam();
    const size_t e = DTypeSize(dtype);
    const int stride = (c.heads + 2 * c.kv_heads) * c.head_dim;
    RopeKvCacheParams p;
    p.positions = positions;
    p.slot_mapping = slots;
    p.inv_freq = inv_freq;
    p.query = qkv;
    p.key = qkv.Slice(e * c.heads * c.head_dim,
                      qkv.size_bytes() - e * c.heads * c.head_dim);
    p.value =
        qkv.Slice(e * (c.heads + c.kv_heads) * c.head_dim,
                  qkv.size_bytes() - e * (c.heads + c.kv_heads) * c.head_dim);
    p.key_cache = key_cache;
    p.value_cache = value_cache;
    p.num_tokens = tokens;
    p.num_heads = c.heads;
    p.num_kv_heads = c.kv_heads;
    p.head_dim = c.head_dim;
    p.block_size = kBlockSize;
    p.num_blocks = kNumBlocks;
    p.query_row_stride = stride;
    p.key_row_stride = stride;
    p.value_row_stride = stride;
    p.dtype = dtype;
    return p;
  }
};

TEST_P(RopeKvCacheCudaTest, MatchesTheCpuKernelAndWritesExactlyTheSlots) {
  const RopeCase c = GetParam();
  const int stride = (c.heads + 2 * c.kv_heads) * c.head_dim;
  const int kv_row = c.kv_heads * c.head_dim;
  const int slots_total = kNumBlocks * kBlockSize;
  // Positions up to 1e5 (long-context angles); slots: padding (-1), the last
  // slot, one past the cache (skipped), and ordinary ones.
  const std::vector<int32_t> positions = {0, 5, 1000, 100000, 7, 31};
  const std::vector<int32_t> slots = {3,           -1, slots_total - 1,
                                      slots_total, 17, 0};
  const int tokens = static_cast<int>(positions.size());
  const std::vector<float> qkv = RandomBf16Floats(tokens * stride, 21);
  RopeConfig rope;
  rope.head_dim = c.head_dim;
  rope.theta = 500000.0;
  const std::vector<float> inv_freq = ComputeRopeInvFreq(rope);
  const size_t cache_elems = static_cast<size_t>(slots_total) * kv_row;

  RopeKvCacheParams cpu_p =
      Params(CpuFloats(qkv), cpu().Upload(positions), cpu().Upload(slots),
             cpu().Upload(inv_freq), cpu().Alloc(4 * cache_elems),
             cpu().Alloc(4 * cache_elems), tokens, DType::kFloat32);
  ASSERT_TRUE(LaunchRopeKvCache(*cpu().stream, cpu_p).ok());
  const std::vector<float> want = cpu().Read<float>(cpu_p.query, qkv.size());

  RopeKvCacheParams gpu_p =
      Params(GpuBf16(qkv), gpu().Upload(positions), gpu().Upload(slots),
             gpu().Upload(inv_freq), gpu().Alloc(2 * cache_elems),
             gpu().Alloc(2 * cache_elems), tokens, DType::kBFloat16);
  ASSERT_TRUE(LaunchRopeKvCache(*gpu().stream, gpu_p).ok());
  const std::vector<uint16_t> got_bits =
      gpu().Read<uint16_t>(gpu_p.query, qkv.size());
  ExpectClose(testing::FromBf16Bits(got_bits), want, 1.0 / 256, 1e-5,
              "rotated q|k, untouched v");
  // v is not rotated: still exactly the input.
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < kv_row; ++i) {
      const size_t at = static_cast<size_t>(t) * stride +
                        (c.heads + c.kv_heads) * c.head_dim + i;
      ASSERT_EQ(testing::FromBf16Bits({got_bits[at]})[0], qkv[at]);
    }
  }

  // Round trip: cache rows hold exactly the rotated k / the v of the token
  // mapped to them; every other row is untouched.
  const std::vector<uint16_t> k_cache =
      gpu().Read<uint16_t>(gpu_p.key_cache, cache_elems);
  const std::vector<uint16_t> v_cache =
      gpu().Read<uint16_t>(gpu_p.value_cache, cache_elems);
  std::vector<int> writer(slots_total, -1);
  for (int t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && slots[t] < slots_total) writer[slots[t]] = t;
  }
  for (int slot = 0; slot < slots_total; ++slot) {
    const int t = writer[slot];
    for (int i = 0; i < kv_row; ++i) {
      const size_t at = static_cast<size_t>(slot) * kv_row + i;
      if (t < 0) {
        ASSERT_EQ(k_cache[at], kPoison) << "slot " << slot << " was written";
        ASSERT_EQ(v_cache[at], kPoison) << "slot " << slot << " was written";
        continue;
      }
      const size_t row = static_cast<size_t>(t) * stride;
      ASSERT_EQ(k_cache[at], got_bits[row + c.heads * c.head_dim + i])
          << "slot " << slot;
      ASSERT_EQ(v_cache[at],
                got_bits[row + (c.heads + c.kv_heads) * c.head_dim + i])
          << "slot " << slot;
    }
  }
}

// Qwen3's per-head q/k norm, partial rotary (Phi-4-mini's 3/4 of the head)
// and a rotary scale, each alone and all together, against the CPU kernel:
// written without a GPU (UnverifiedCudaKernels), this is their first run.
// Tolerance: the GPU rounds the normalized values to bf16 before rotating
// and the result again, 2^-7 relative, plus the norm's fp32 sum order.
TEST_P(RopeKvCacheCudaTest, QkNormPartialRotaryAndScaleMatchTheCpuKernel) {
  const RopeCase c = GetParam();
  const int stride = (c.heads + 2 * c.kv_heads) * c.head_dim;
  const int kv_row = c.kv_heads * c.head_dim;
  const int slots_total = kNumBlocks * kBlockSize;
  const std::vector<int32_t> positions = {0, 5, 1000, 100000, 7, 31};
  const std::vector<int32_t> slots = {3, -1, slots_total - 1, 12, 17, 0};
  const int tokens = static_cast<int>(positions.size());
  const std::vector<float> qkv = RandomBf16Floats(tokens * stride, 23);
  const std::vector<float> q_weight = RandomBf16Floats(c.head_dim, 24);
  const std::vector<float> k_weight = RandomBf16Floats(c.head_dim, 25);
  const size_t cache_elems = static_cast<size_t>(slots_total) * kv_row;
  struct Variant {
    bool qk_norm;
    int rotary_dim;
    float scale;
  };
  const int partial = c.head_dim * 3 / 4 / 2 * 2;
  for (const Variant v :
       {Variant{true, c.head_dim, 1.0f}, Variant{false, partial, 1.0f},
        Variant{false, c.head_dim, 1.3f}, Variant{true, partial, 1.3f}}) {
    SCOPED_TRACE(::testing::Message()
                 << "qk_norm " << v.qk_norm << ", rotary_dim " << v.rotary_dim
                 << ", scale " << v.scale);
    RopeConfig rope;
    rope.head_dim = v.rotary_dim;
    rope.theta = 1000000.0;
    const std::vector<float> inv_freq = ComputeRopeInvFreq(rope);
    RopeKvCacheParams cpu_p =
        Params(CpuFloats(qkv), cpu().Upload(positions), cpu().Upload(slots),
               cpu().Upload(inv_freq), cpu().Alloc(4 * cache_elems),
               cpu().Alloc(4 * cache_elems), tokens, DType::kFloat32);
    RopeKvCacheParams gpu_p =
        Params(GpuBf16(qkv), gpu().Upload(positions), gpu().Upload(slots),
               gpu().Upload(inv_freq), gpu().Alloc(2 * cache_elems),
               gpu().Alloc(2 * cache_elems), tokens, DType::kBFloat16);
    for (RopeKvCacheParams* p : {&cpu_p, &gpu_p}) {
      p->rotary_dim = v.rotary_dim;
      p->rotary_scale = v.scale;
      if (v.qk_norm) p->qk_norm_epsilon = 1e-6f;
    }
    if (v.qk_norm) {
      cpu_p.q_norm_weight = CpuFloats(q_weight);
      cpu_p.k_norm_weight = CpuFloats(k_weight);
      gpu_p.q_norm_weight = GpuBf16(q_weight);
      gpu_p.k_norm_weight = GpuBf16(k_weight);
    }
    ASSERT_TRUE(LaunchRopeKvCache(*cpu().stream, cpu_p).ok());
    ASSERT_TRUE(LaunchRopeKvCache(*gpu().stream, gpu_p).ok());
    const std::vector<float> want = cpu().Read<float>(cpu_p.query, qkv.size());
    const std::vector<uint16_t> got_bits =
        gpu().Read<uint16_t>(gpu_p.query, qkv.size());
    ExpectClose(testing::FromBf16Bits(got_bits), want, 1.0 / 128, 2e-3,
                "normalized, rotated q|k, untouched v");
    // The cache holds exactly the GPU's k (the unrotated tail included).
    const std::vector<uint16_t> k_cache =
        gpu().Read<uint16_t>(gpu_p.key_cache, cache_elems);
    for (int t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      for (int i = 0; i < kv_row; ++i) {
        ASSERT_EQ(k_cache[static_cast<size_t>(slots[t]) * kv_row + i],
                  got_bits[static_cast<size_t>(t) * stride +
                           c.heads * c.head_dim + i])
            << "token " << t << " value " << i;
      }
    }
  }
}

TEST_P(RopeKvCacheCudaTest, GraphReplayReadsPositionsAndSlotsAtRunTime) {
  const RopeCase c = GetParam();
  const int stride = (c.heads + 2 * c.kv_heads) * c.head_dim;
  const int tokens = 4;
  const size_t cache_elems =
      static_cast<size_t>(kNumBlocks) * kBlockSize * c.kv_heads * c.head_dim;
  const std::vector<float> qkv = RandomBf16Floats(tokens * stride, 22);
  RopeConfig rope;
  rope.head_dim = c.head_dim;
  DeviceBuffer input = GpuBf16(qkv);
  DeviceBuffer work = gpu().Alloc(2 * qkv.size());
  RopeKvCacheParams p = Params(
      work, gpu().Upload(std::vector<int32_t>{0, 1, 2, 3}),
      gpu().Upload(std::vector<int32_t>{0, 1, 2, 3}),
      gpu().Upload(ComputeRopeInvFreq(rope)), gpu().Alloc(2 * cache_elems),
      gpu().Alloc(2 * cache_elems), tokens, DType::kBFloat16);
  Stream& stream = *gpu().stream;
  const size_t bytes = 2 * qkv.size();
  ASSERT_TRUE(stream.CopyOnDevice(work, input, bytes).ok());
  ASSERT_TRUE(LaunchRopeKvCache(stream, p).ok());  // warm-up
  ASSERT_TRUE(stream.BeginCapture().ok());
  ASSERT_TRUE(stream.CopyOnDevice(work, input, bytes).ok());
  ASSERT_TRUE(LaunchRopeKvCache(stream, p).ok());
  auto graph = stream.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  gpu().Write(p.positions, std::vector<int32_t>{90, 4000, 7, 12});
  gpu().Write(p.slot_mapping, std::vector<int32_t>{-1, 9, 38, 5});
  ASSERT_TRUE((*graph)->Replay().ok());
  const auto replay_q = gpu().Read<uint16_t>(work, qkv.size());
  const auto replay_k = gpu().Read<uint16_t>(p.key_cache, cache_elems);
  ASSERT_TRUE(stream.CopyOnDevice(work, input, bytes).ok());
  ASSERT_TRUE(LaunchRopeKvCache(stream, p).ok());
  EXPECT_EQ(gpu().Read<uint16_t>(work, qkv.size()), replay_q);
  EXPECT_EQ(gpu().Read<uint16_t>(p.key_cache, cache_elems), replay_k);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeKvCacheCudaTest,
                         ::testing::Values(RopeCase{8, 2, 64},
                                           RopeCase{4, 4, 16},
                                           RopeCase{32, 8, 128},
                                           RopeCase{4, 1, 256}));

}  // namespace
}  // namespace kernels
}  // namespace pdworker
