// Randomized check of CudagraphDispatcher against an independent oracle
// written from the seeds' rules (fixed seed, so failures reproduce).
#include <algorithm>
#include <optional>
#include <random>
#include <vector>

#include "dispatcher/cudagraph_dispatcher.h"
#include "gtest/gtest.h"

namespace pdworker {
namespace {

// Smallest element of `sizes` >= n, if any.
std::optional<int> SmallestAtLeast(const std::vector<int>& sizes, int n) {
  for (int s : sizes) {
    if (s >= n) return s;
  }
  return std::nullopt;
}

// Oracle for the uniform-decode sizes: floor(s / q) * q for every capture
// size, positive and reachable by max_num_seqs requests.
std::vector<int> OracleUniformSizes(const std::vector<int>& sizes, int q,
                                    int max_num_seqs) {
  std::vector<int> out;
  for (int s : sizes) {
    const int r = s - s % q;
    if (r > 0 && r <= q * max_num_seqs) out.push_back(r);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

TEST(DispatcherPropertyTest, MatchesOracleOnRandomConfigs) {
  std::mt19937 rng(20261122);
  const auto modes = CudaGraphMode::All();
  int graph_dispatches = 0;
  for (int trial = 0; trial < 300; ++trial) {
    // Random strictly increasing capture sizes in [1, 600].
    std::vector<int> sizes;
    const int density = std::uniform_int_distribution<int>(2, 40)(rng);
    for (int s = 1; s <= 600; ++s) {
      if (std::uniform_int_distribution<int>(0, density)(rng) == 0) {
        sizes.push_back(s);
      }
    }
    if (sizes.empty()) sizes.push_back(1 + trial % 7);
    const CudaGraphMode mode = modes[trial % modes.size()];
    const int q = std::uniform_int_distribution<int>(1, 4)(rng);
    const int max_num_seqs = std::uniform_int_distribution<int>(1, 300)(rng);

    CudagraphDispatcher d;
    ASSERT_TRUE(d.Initialize(mode, sizes, max_num_seqs, q).ok());
    const int max_size = sizes.back();
    const std::vector<int> uniform_sizes =
        mode.decode_mode() == RuntimeMode::kFull
            ? OracleUniformSizes(sizes, q, max_num_seqs)
            : std::vector<int>{};
    // With speculation (q > 1), one-token decode steps have keys too.
    const std::vector<int> one_token_sizes =
        mode.decode_mode() == RuntimeMode::kFull && q > 1
            ? OracleUniformSizes(sizes, 1, max_num_seqs)
            : std::vector<int>{};

    for (int i = 0; i < 400; ++i) {
      const int n = std::uniform_int_distribution<int>(1, max_size + 20)(rng);
      const BatchKind kind = i % 3 == 0   ? BatchKind::kMixed
                             : i % 3 == 1 ? BatchKind::kUniformDecode
                             : q > 1      ? BatchKind::kOneTokenDecode
                                          : BatchKind::kUniformDecode;
      const int query_len = kind == BatchKind::kOneTokenDecode ? 1 : q;
      const DispatchResult r = d.Dispatch(n, kind);
      SCOPED_TRACE(::testing::Message()
                   << "trial " << trial << " mode " << mode << " q " << q
                   << " max_num_seqs " << max_num_seqs << " n " << n << " kind "
                   << kind << " -> " << r);

      if (mode == CudaGraphMode::None()) {
        EXPECT_EQ(r.mode, RuntimeMode::kNone);
        EXPECT_EQ(r.reason, FallbackReason::kModeNone);
        continue;
      }
      if (n > max_size) {
        EXPECT_EQ(r.mode, RuntimeMode::kNone);
        EXPECT_EQ(r.reason, FallbackReason::kAboveMaxCaptureSize);
        EXPECT_EQ(r.descriptor, (BatchDescriptor{n, 0, false}));
        continue;
      }

      // Expected decision by the priority exact FULL > relaxed FULL >
      // relaxed PIECEWISE > NONE.
      std::optional<int> uniform_pad;
      if (kind != BatchKind::kMixed) {
        uniform_pad =
            SmallestAtLeast(kind == BatchKind::kOneTokenDecode ? one_token_sizes
                                                               : uniform_sizes,
                            n);
      }
      const int relaxed_pad = *SmallestAtLeast(sizes, n);
      DispatchResult expected;
      if (uniform_pad.has_value()) {
        expected = {
            RuntimeMode::kFull,
            BatchDescriptor{*uniform_pad, *uniform_pad / query_len, true},
            FallbackReason::kNone};
      } else if (mode.mixed_mode() != RuntimeMode::kNone) {
        expected = {mode.mixed_mode(), BatchDescriptor{relaxed_pad, 0, false},
                    FallbackReason::kNone};
      } else {
        expected = {RuntimeMode::kNone, BatchDescriptor{n, 0, false},
                    FallbackReason::kNoKeyForBatchShape};
      }
      EXPECT_EQ(r, expected);

      if (r.mode != RuntimeMode::kNone) {
        ++graph_dispatches;
        // Every dispatched key was created by Initialize.
        EXPECT_TRUE(d.keys(r.mode).contains(r.descriptor));
        // Padding never shrinks a batch and is minimal among usable sizes.
        EXPECT_GE(r.descriptor.num_tokens, n);
        if (!r.descriptor.uniform) {
          EXPECT_EQ(r.descriptor.num_tokens, relaxed_pad);
        } else {
          EXPECT_EQ(r.descriptor.num_tokens % query_len, 0);
          EXPECT_EQ(r.descriptor.num_reqs * query_len, r.descriptor.num_tokens);
          EXPECT_LE(r.descriptor.num_reqs, max_num_seqs);
        }
      }
    }
  }
  // The test is only meaningful if graphs were actually dispatched.
  EXPECT_GT(graph_dispatches, 10000);
}

TEST(DispatcherPropertyTest, KeysAreExactlyTheSeedConstruction) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int> sizes;
    for (int s = 1; s <= 300; ++s) {
      if (std::uniform_int_distribution<int>(0, 9)(rng) == 0)
        sizes.push_back(s);
    }
    if (sizes.empty()) sizes.push_back(5);
    const CudaGraphMode mode = CudaGraphMode::All()[trial % 5];
    const int q = 1 + trial % 3;
    const int max_num_seqs = std::uniform_int_distribution<int>(1, 100)(rng);
    CudagraphDispatcher d;
    ASSERT_TRUE(d.Initialize(mode, sizes, max_num_seqs, q).ok());

    absl::flat_hash_set<BatchDescriptor> full, piecewise;
    for (int s : sizes) {
      if (mode.mixed_mode() == RuntimeMode::kFull) full.insert({s, 0, false});
      if (mode.mixed_mode() == RuntimeMode::kPiecewise) {
        piecewise.insert({s, 0, false});
      }
    }
    if (mode.decode_mode() == RuntimeMode::kFull) {
      for (int s : OracleUniformSizes(sizes, q, max_num_seqs)) {
        full.insert({s, s / q, true});
      }
      // With speculation (q > 1), one-token decode keys too.
      if (q > 1) {
        for (int s : OracleUniformSizes(sizes, 1, max_num_seqs)) {
          full.insert({s, s, true});
        }
      }
    }
    EXPECT_EQ(d.keys(RuntimeMode::kFull), full) << mode;
    EXPECT_EQ(d.keys(RuntimeMode::kPiecewise), piecewise) << mode;

    // GetCaptureDescs lists each key once, grouped and largest first.
    size_t listed = 0;
    RuntimeMode previous = RuntimeMode::kNone;
    for (const auto& [runtime_mode, descs] : d.GetCaptureDescs()) {
      EXPECT_NE(runtime_mode, RuntimeMode::kNone);
      if (previous == RuntimeMode::kFull) {
        ADD_FAILURE() << "FULL must come last";
      }
      previous = runtime_mode;
      for (size_t i = 0; i < descs.size(); ++i) {
        EXPECT_TRUE(d.keys(runtime_mode).contains(descs[i]));
        if (i > 0) {
          EXPECT_GE(descs[i - 1].num_tokens, descs[i].num_tokens);
        }
      }
      listed += descs.size();
    }
    EXPECT_EQ(listed, full.size() + piecewise.size());
  }
}

}  // namespace
}  // namespace pdworker
