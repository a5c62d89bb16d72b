#include "worker/kernels/rope_kv_cache.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::BitIdentical;
using testing::IsInvalidArgumentMentioning;
using testing::KernelTest;
using testing::MaxAbsDiff;
using testing::RandomFloats;

constexpr double kTwoPi = 6.283185307179586;

// ---------------------------------------------------------------------------
// inv_freq

TEST(RopeInvFreqTest, DefaultIsThetaPowers) {
  RopeConfig config;
  config.head_dim = 64;
  config.theta = 10000.0;
  const std::vector<float> inv_freq = ComputeRopeInvFreq(config);
  ASSERT_EQ(inv_freq.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double expected = std::exp(-std::log(10000.0) * (2.0 * i) / 64.0);
    EXPECT_NEAR(inv_freq[i], expected, 1e-7 * expected) << i;
  }
}

// Llama 3.1 8B's values. Independent formulation: r = how many wavelengths
// fit into the original context; r < low -> frequency / factor, r > high ->
// unchanged, in between a linear blend in r.
TEST(RopeInvFreqTest, Llama3ScalingMatchesReference) {
  RopeConfig config;
  config.head_dim = 128;
  config.theta = 500000.0;
  config.scaling = RopeScalingType::kLlama3;
  config.factor = 8.0;
  config.low_freq_factor = 1.0;
  config.high_freq_factor = 4.0;
  config.original_max_position_embeddings = 8192;
  const std::vector<float> inv_freq = ComputeRopeInvFreq(config);
  ASSERT_EQ(inv_freq.size(), 64u);
  int scaled = 0, kept = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(500000.0, -(2.0 * i) / 128.0);
    const double r = 8192.0 * base / kTwoPi;
    double expected;
    if (r < 1.0) {
      expected = base / 8.0;
      ++scaled;
    } else if (r > 4.0) {
      expected = base;
      ++kept;
    } else {
      const double s = (r - 1.0) / 3.0;
      expected = base * (s + (1.0 - s) / 8.0);
      ++blended;
    }
    EXPECT_NEAR(inv_freq[i], expected, 1e-6 * expected) << i;
    if (i > 0) {
      EXPECT_LT(inv_freq[i], inv_freq[i - 1]) << i;
    }
  }
  // All three bands are exercised.
  EXPECT_GT(scaled, 0);
  EXPECT_GT(kept, 0);
  EXPECT_GT(blended, 0);
  EXPECT_EQ(inv_freq[0], 1.0f);
}

// LongRoPE: each pair's plain frequency divided by its own factor
// (transformers' 1 / (ext_factors * base^(2i/dim))), over the rotary dim.
TEST(RopeInvFreqTest, LongropeDividesEachPairByItsFactor) {
  RopeConfig config;
  config.head_dim = 12;  // the rotary dim: 12 of a head of 16
  config.theta = 10000.0;
  config.scaling = RopeScalingType::kLongrope;
  config.pair_factors = {1.0, 1.5, 2.5, 5.0, 9.0, 16.0};
  const std::vector<float> inv_freq = ComputeRopeInvFreq(config);
  ASSERT_EQ(inv_freq.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    const double expected =
        1.0 / (config.pair_factors[i] * std::pow(10000.0, 2.0 * i / 12.0));
    EXPECT_NEAR(inv_freq[i], expected, 1e-7 * expected) << i;
  }
  config.pair_factors.pop_back();
  EXPECT_THAT(ValidateRopeConfig(config),
              IsInvalidArgumentMentioning("one factor per pair"));
  config.pair_factors = {1.0, 1.5, 2.5, 0.0, 9.0, 16.0};
  EXPECT_THAT(ValidateRopeConfig(config),
              IsInvalidArgumentMentioning("positive"));
}

TEST(RopeInvFreqTest, ValidateRejectsBadConfigs) {
  RopeConfig config;
  config.head_dim = 63;
  EXPECT_THAT(ValidateRopeConfig(config),
              IsInvalidArgumentMentioning("head_dim"));
  config.head_dim = 64;
  EXPECT_TRUE(ValidateRopeConfig(config).ok());
  config.theta = 0.0;
  EXPECT_THAT(ValidateRopeConfig(config),
              IsInvalidArgumentMentioning("rope_theta"));
  config.theta = 10000.0;
  config.scaling = RopeScalingType::kLlama3;
  config.low_freq_factor = 4.0;
  config.high_freq_factor = 4.0;
  EXPECT_THAT(ValidateRopeConfig(config),
              IsInvalidArgumentMentioning("high_freq_factor"));
}

// ---------------------------------------------------------------------------
// The op

struct Shape {
  int num_tokens = 6;
  int num_heads = 4;
  int num_kv_heads = 2;
  int head_dim = 16;
  int block_size = 4;
  int num_blocks = 8;
  int q_width() const { return num_heads * head_dim; }
  int kv_width() const { return num_kv_heads * head_dim; }
  int cache_elements() const { return num_blocks * block_size * kv_width(); }
};

// HF's formula: x * cos + rotate_half(x) * sin, with cos/sin of
// cat(freqs, freqs), freqs = fp32(position) * inv_freq in fp32.
std::vector<double> ReferenceRope(const std::vector<float>& x, int rows,
                                  int heads, int head_dim,
                                  const std::vector<int32_t>& positions,
                                  const std::vector<float>& inv_freq) {
  const int half = head_dim / 2;
  std::vector<double> out(x.size());
  for (int t = 0; t < rows; ++t) {
    std::vector<double> cos_full(head_dim), sin_full(head_dim);
    for (int d = 0; d < head_dim; ++d) {
      const float freq = static_cast<float>(positions[t]) * inv_freq[d % half];
      cos_full[d] = std::cos(static_cast<double>(freq));
      sin_full[d] = std::sin(static_cast<double>(freq));
    }
    for (int h = 0; h < heads; ++h) {
      const float* v = &x[(t * heads + h) * head_dim];
      for (int d = 0; d < head_dim; ++d) {
        const double rotated = d < half ? -double{v[d + half]} : v[d - half];
        out[(t * heads + h) * head_dim + d] =
            v[d] * cos_full[d] + rotated * sin_full[d];
      }
    }
  }
  return out;
}

class RopeKvCacheTest : public KernelTest {
 protected:
  void SetUp() override {
    KernelTest::SetUp();
    RopeConfig config;
    config.head_dim = shape_.head_dim;
    config.theta = 10000.0;
    inv_freq_ = ComputeRopeInvFreq(config);
    q_ = RandomFloats(shape_.num_tokens * shape_.q_width(), 41);
    k_ = RandomFloats(shape_.num_tokens * shape_.kv_width(), 42);
    v_ = RandomFloats(shape_.num_tokens * shape_.kv_width(), 43);
    key_cache_init_ = RandomFloats(shape_.cache_elements(), 44);
    value_cache_init_ = RandomFloats(shape_.cache_elements(), 45);

    p_.positions = AllocElements<int32_t>(shape_.num_tokens);
    p_.slot_mapping = AllocElements<int32_t>(shape_.num_tokens);
    p_.inv_freq = Upload(inv_freq_);
    p_.query = AllocElements<float>(q_.size());
    p_.key = AllocElements<float>(k_.size());
    p_.value = AllocElements<float>(v_.size());
    p_.key_cache = AllocElements<float>(shape_.cache_elements());
    p_.value_cache = AllocElements<float>(shape_.cache_elements());
    p_.num_tokens = shape_.num_tokens;
    p_.num_heads = shape_.num_heads;
    p_.num_kv_heads = shape_.num_kv_heads;
    p_.head_dim = shape_.head_dim;
    p_.block_size = shape_.block_size;
    p_.num_blocks = shape_.num_blocks;
  }

  // Writes the step inputs and fresh activations/caches into the static
  // buffers (what the runner does before a launch or a replay).
  void WriteStep(const std::vector<int32_t>& positions,
                 const std::vector<int32_t>& slots) {
    Write(p_.positions, positions);
    Write(p_.slot_mapping, slots);
    Write(p_.query, q_);
    Write(p_.key, k_);
    Write(p_.value, v_);
    Write(p_.key_cache, key_cache_init_);
    Write(p_.value_cache, value_cache_init_);
  }

  // Checks q/k rotation, the cache rows at `slots` and that every other
  // cache row is untouched.
  void ExpectStepResult(const std::vector<int32_t>& positions,
                        const std::vector<int32_t>& slots) {
    const std::vector<double> q_ref =
        ReferenceRope(q_, shape_.num_tokens, shape_.num_heads, shape_.head_dim,
                      positions, inv_freq_);
    const std::vector<double> k_ref =
        ReferenceRope(k_, shape_.num_tokens, shape_.num_kv_heads,
                      shape_.head_dim, positions, inv_freq_);
    // |x| < 1, two products per element: a few ulps of fp32.
    EXPECT_LE(MaxAbsDiff(Read<float>(p_.query), q_ref), 2e-6);
    EXPECT_LE(MaxAbsDiff(Read<float>(p_.key), k_ref), 2e-6);
    EXPECT_EQ(Read<float>(p_.value), v_);

    std::vector<double> key_expected(key_cache_init_.begin(),
                                     key_cache_init_.end());
    std::vector<double> value_expected(value_cache_init_.begin(),
                                       value_cache_init_.end());
    const int w = shape_.kv_width();
    for (int t = 0; t < shape_.num_tokens; ++t) {
      if (slots[t] < 0) continue;
      for (int i = 0; i < w; ++i) {
        key_expected[slots[t] * w + i] = k_ref[t * w + i];
        value_expected[slots[t] * w + i] = v_[t * w + i];
      }
    }
    const std::vector<float> key_cache = Read<float>(p_.key_cache);
    const std::vector<float> value_cache = Read<float>(p_.value_cache);
    EXPECT_LE(MaxAbsDiff(key_cache, key_expected), 2e-6);
    EXPECT_LE(MaxAbsDiff(value_cache, value_expected), 0.0);
    // Rows no slot points at keep their exact bytes (padding writes nothing).
    std::vector<bool> written(shape_.num_blocks * shape_.block_size, false);
    for (int32_t s : slots) {
      if (s >= 0) written[s] = true;
    }
    for (size_t row = 0; row < written.size(); ++row) {
      if (written[row]) continue;
      for (int i = 0; i < w; ++i) {
        ASSERT_EQ(key_cache[row * w + i], key_cache_init_[row * w + i])
            << "key row " << row;
        ASSERT_EQ(value_cache[row * w + i], value_cache_init_[row * w + i])
            << "value row " << row;
      }
    }
  }

  Shape shape_;
  std::vector<float> inv_freq_, q_, k_, v_, key_cache_init_, value_cache_init_;
  RopeKvCacheParams p_;
};

// Tokens 4 and 5 are padding (slot -1); the real slots are scattered over
// non-adjacent blocks (block 6 offset 1, block 2 offset 3, ...).
const std::vector<int32_t> kPositionsA = {0, 1, 17, 1999, 0, 0};
const std::vector<int32_t> kSlotsA = {25, 11, 0, 31, -1, -1};

TEST_F(RopeKvCacheTest, RotatesQkAndWritesTheCacheAtSlots) {
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  ExpectStepResult(kPositionsA, kSlotsA);
}

TEST_F(RopeKvCacheTest, PositionZeroIsIdentity) {
  WriteStep(std::vector<int32_t>(shape_.num_tokens, 0),
            std::vector<int32_t>(shape_.num_tokens, -1));
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  EXPECT_EQ(Read<float>(p_.query), q_);
  EXPECT_EQ(Read<float>(p_.key), k_);
  EXPECT_EQ(Read<float>(p_.key_cache), key_cache_init_);
}

TEST_F(RopeKvCacheTest, StridedViewsOfAFusedQkvBufferMatchDenseBuffers) {
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  const std::vector<float> q_dense = Read<float>(p_.query);
  const std::vector<float> k_dense = Read<float>(p_.key);
  const std::vector<float> key_cache_dense = Read<float>(p_.key_cache);

  // [T, q | k | v] as a fused qkv projection writes it.
  const int qw = shape_.q_width(), kvw = shape_.kv_width();
  const int row = qw + 2 * kvw;
  std::vector<float> fused(shape_.num_tokens * row);
  for (int t = 0; t < shape_.num_tokens; ++t) {
    for (int i = 0; i < qw; ++i) fused[t * row + i] = q_[t * qw + i];
    for (int i = 0; i < kvw; ++i) {
      fused[t * row + qw + i] = k_[t * kvw + i];
      fused[t * row + qw + kvw + i] = v_[t * kvw + i];
    }
  }
  DeviceBuffer qkv = Upload(fused);
  Write(p_.key_cache, key_cache_init_);
  RopeKvCacheParams strided = p_;
  const size_t bytes = qkv.size_bytes();
  strided.query = qkv.Slice(0, bytes);
  strided.key = qkv.Slice(sizeof(float) * qw, bytes - sizeof(float) * qw);
  strided.value =
      qkv.Slice(sizeof(float) * (qw + kvw), bytes - sizeof(float) * (qw + kvw));
  strided.query_row_stride = row;
  strided.key_row_stride = row;
  strided.value_row_stride = row;
  ASSERT_TRUE(LaunchRopeKvCache(stream(), strided).ok());
  const std::vector<float> out = Read<float>(qkv);
  for (int t = 0; t < shape_.num_tokens; ++t) {
    for (int i = 0; i < qw; ++i) {
      ASSERT_EQ(out[t * row + i], q_dense[t * qw + i]);
    }
    for (int i = 0; i < kvw; ++i) {
      ASSERT_EQ(out[t * row + qw + i], k_dense[t * kvw + i]);
      ASSERT_EQ(out[t * row + qw + kvw + i], v_[t * kvw + i]);
    }
  }
  EXPECT_TRUE(BitIdentical(Read<float>(p_.key_cache), key_cache_dense));
}

// Captured with one step's positions/slots, replayed after the runner wrote
// another step's: the replay must use the new contents (run-time reads).
TEST_F(RopeKvCacheTest, GraphReplayReadsPositionsAndSlotsAtRunTime) {
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(stream().BeginCapture().ok());
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  absl::StatusOr<std::unique_ptr<CapturedGraph>> graph = stream().EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();

  const std::vector<int32_t> positions_b = {5, 300, 7, 7, 1, 0};
  const std::vector<int32_t> slots_b = {3, -1, 20, 21, 9, -1};
  WriteStep(positions_b, slots_b);
  ASSERT_TRUE((*graph)->Replay().ok());
  const std::vector<float> q_replay = Read<float>(p_.query);
  const std::vector<float> k_cache_replay = Read<float>(p_.key_cache);
  const std::vector<float> v_cache_replay = Read<float>(p_.value_cache);
  ExpectStepResult(positions_b, slots_b);

  WriteStep(positions_b, slots_b);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  EXPECT_TRUE(BitIdentical(Read<float>(p_.query), q_replay));
  EXPECT_TRUE(BitIdentical(Read<float>(p_.key_cache), k_cache_replay));
  EXPECT_TRUE(BitIdentical(Read<float>(p_.value_cache), v_cache_replay));
}

// Qwen3's q/k norm: each head of q and k is RMS-normalized and scaled by
// its weight before the rotation, and the cache gets the normalized,
// rotated k. The reference normalizes in double, then rotates as above.
TEST_F(RopeKvCacheTest, QkNormNormalizesEachHeadBeforeTheRotation) {
  const int d = shape_.head_dim;
  const std::vector<float> q_weight = RandomFloats(d, 46);
  const std::vector<float> k_weight = RandomFloats(d, 47);
  constexpr double kEps = 1e-6;
  auto normalize = [&](std::vector<float> x, const std::vector<float>& w) {
    for (size_t head = 0; head < x.size() / d; ++head) {
      double sum_squares = 0;
      for (int i = 0; i < d; ++i) {
        sum_squares += double{x[head * d + i]} * x[head * d + i];
      }
      const double inv_rms = 1.0 / std::sqrt(sum_squares / d + kEps);
      for (int i = 0; i < d; ++i) {
        x[head * d + i] = static_cast<float>(x[head * d + i] * inv_rms * w[i]);
      }
    }
    return x;
  };
  const std::vector<double> q_ref =
      ReferenceRope(normalize(q_, q_weight), shape_.num_tokens,
                    shape_.num_heads, d, kPositionsA, inv_freq_);
  const std::vector<double> k_ref =
      ReferenceRope(normalize(k_, k_weight), shape_.num_tokens,
                    shape_.num_kv_heads, d, kPositionsA, inv_freq_);

  RopeKvCacheParams p = p_;
  p.q_norm_weight = Upload(q_weight);
  p.k_norm_weight = Upload(k_weight);
  p.qk_norm_epsilon = static_cast<float>(kEps);
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p).ok());
  // Normalized values are O(1) (not < 1): a few more ulps than above.
  EXPECT_LE(MaxAbsDiff(Read<float>(p.query), q_ref), 1e-5);
  EXPECT_LE(MaxAbsDiff(Read<float>(p.key), k_ref), 1e-5);
  const std::vector<float> key_cache = Read<float>(p.key_cache);
  const int w = shape_.kv_width();
  for (int t = 0; t < shape_.num_tokens; ++t) {
    if (kSlotsA[t] < 0) continue;
    for (int i = 0; i < w; ++i) {
      EXPECT_NEAR(key_cache[kSlotsA[t] * w + i], k_ref[t * w + i], 1e-5);
    }
  }
  // Without the norm the same step gives other values: the test can fail.
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  EXPECT_GT(MaxAbsDiff(Read<float>(p_.query), q_ref), 1e-2);
}

TEST_F(RopeKvCacheTest, QkNormWeightsComeTogetherWithTheirShape) {
  RopeKvCacheParams bad = p_;
  bad.q_norm_weight = AllocElements<float>(shape_.head_dim);
  bad.qk_norm_epsilon = 1e-6f;
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("k_norm_weight"));
  bad.k_norm_weight = AllocElements<float>(shape_.head_dim - 1);
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("'k_norm_weight'"));
  bad.k_norm_weight = AllocElements<float>(shape_.head_dim);
  bad.qk_norm_epsilon = 0;
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("qk_norm_epsilon"));
  bad.qk_norm_epsilon = 1e-6f;
  EXPECT_TRUE(LaunchRopeKvCache(stream(), bad).ok());
}

// Partial rotary (Phi-4-mini): only each head's first rotary_dim values
// rotate, as pairs (i, i + rotary_dim / 2), with cos and sin times
// rotary_scale; the rest of the head, and v, keep their bits.
TEST_F(RopeKvCacheTest, PartialRotaryRotatesTheLeadingValuesOnly) {
  constexpr int kRotary = 12;
  constexpr float kScale = 1.25f;
  const int d = shape_.head_dim;
  RopeConfig config;
  config.head_dim = kRotary;
  config.theta = 10000.0;
  const std::vector<float> inv_freq = ComputeRopeInvFreq(config);
  // The reference: HF's apply_rotary_pos_emb on x[..., :rotary] with cos
  // and sin scaled (transformers' attention_scaling), x[..., rotary:] as is.
  auto reference = [&](const std::vector<float>& x, int heads) {
    std::vector<float> leading, trailing;
    for (size_t row = 0; row < x.size() / d; ++row) {
      leading.insert(leading.end(), x.begin() + row * d,
                     x.begin() + row * d + kRotary);
    }
    const std::vector<double> rotated = ReferenceRope(
        leading, shape_.num_tokens, heads, kRotary, kPositionsA, inv_freq);
    std::vector<double> out(x.size());
    for (size_t row = 0; row < x.size() / d; ++row) {
      for (int i = 0; i < d; ++i) {
        out[row * d + i] = i < kRotary ? kScale * rotated[row * kRotary + i]
                                       : double{x[row * d + i]};
      }
    }
    return out;
  };
  RopeKvCacheParams p = p_;
  p.inv_freq = Upload(inv_freq);
  p.rotary_dim = kRotary;
  p.rotary_scale = kScale;
  WriteStep(kPositionsA, kSlotsA);
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p).ok());
  const std::vector<float> q = Read<float>(p.query);
  const std::vector<float> k = Read<float>(p.key);
  EXPECT_LE(MaxAbsDiff(q, reference(q_, shape_.num_heads)), 4e-6);
  EXPECT_LE(MaxAbsDiff(k, reference(k_, shape_.num_kv_heads)), 4e-6);
  for (size_t row = 0; row < q.size() / d; ++row) {
    for (int i = kRotary; i < d; ++i) {
      ASSERT_EQ(q[row * d + i], q_[row * d + i]) << "unrotated values move";
    }
  }
  EXPECT_EQ(Read<float>(p.value), v_);
  const std::vector<float> key_cache = Read<float>(p.key_cache);
  const int w = shape_.kv_width();
  for (int t = 0; t < shape_.num_tokens; ++t) {
    if (kSlotsA[t] < 0) continue;
    for (int i = 0; i < w; ++i) {
      EXPECT_EQ(key_cache[kSlotsA[t] * w + i], k[t * w + i]);
    }
  }
  // The whole head rotating gives other values: the test can fail.
  EXPECT_GT(MaxAbsDiff(q, ReferenceRope(q_, shape_.num_tokens, shape_.num_heads,
                                        d, kPositionsA, inv_freq_)),
            1e-2);
}

TEST_F(RopeKvCacheTest, PartialRotaryChecksItsDimensionScaleAndTable) {
  RopeKvCacheParams bad = p_;
  bad.rotary_dim = 11;
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("rotary_dim"));
  bad.rotary_dim = shape_.head_dim + 2;
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("rotary_dim"));
  bad = p_;
  bad.rotary_scale = 0;
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("rotary_scale"));
  // inv_freq holds rotary_dim / 2 entries: a shorter table is refused, a
  // head_dim / 2 one serves a rotary_dim below it.
  bad = p_;
  bad.rotary_dim = 12;
  bad.inv_freq = AllocElements<float>(5);
  EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
              IsInvalidArgumentMentioning("inv_freq"));
  bad.inv_freq = AllocElements<float>(6);
  EXPECT_TRUE(LaunchRopeKvCache(stream(), bad).ok());
}

TEST_F(RopeKvCacheTest, RejectsBadBuffers) {
  ASSERT_TRUE(LaunchRopeKvCache(stream(), p_).ok());
  auto expect_rejected = [&](RopeKvCacheParams bad, const char* name) {
    EXPECT_THAT(LaunchRopeKvCache(stream(), bad),
                IsInvalidArgumentMentioning(name));
  };
  RopeKvCacheParams bad = p_;
  bad.positions = AllocElements<int32_t>(shape_.num_tokens - 1);
  expect_rejected(bad, "'positions'");
  bad = p_;
  bad.slot_mapping = AllocElements<int32_t>(shape_.num_tokens - 1);
  expect_rejected(bad, "'slot_mapping'");
  bad = p_;
  bad.inv_freq = AllocElements<float>(shape_.head_dim / 2 - 1);
  expect_rejected(bad, "'inv_freq'");
  bad = p_;
  bad.query = AllocElements<float>(q_.size() - 1);
  expect_rejected(bad, "'query'");
  bad = p_;
  bad.key = AllocElements<float>(k_.size() - 1);
  expect_rejected(bad, "'key'");
  bad = p_;
  bad.value = AllocElements<float>(v_.size() - 1);
  expect_rejected(bad, "'value'");
  bad = p_;
  bad.key_cache = AllocElements<float>(shape_.cache_elements() - 1);
  expect_rejected(bad, "'key_cache'");
  bad = p_;
  bad.value_cache = AllocElements<float>(shape_.cache_elements() - 1);
  expect_rejected(bad, "'value_cache'");
  bad = p_;
  bad.query_row_stride = shape_.q_width() + 4;  // buffer is dense
  expect_rejected(bad, "'query'");
  bad = p_;
  bad.key_row_stride = 3;
  expect_rejected(bad, "row strides");
  bad = p_;
  bad.head_dim = 15;
  expect_rejected(bad, "head_dim");
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
