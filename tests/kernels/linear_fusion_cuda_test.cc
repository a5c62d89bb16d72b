// The skinny GEMMs' decode-step fusions on CUDA (RMSNorm prologue,
// residual-add and RoPE + KV-cache epilogues) against the separate kernels
// they replace, bit for bit, and their refusals. The GEMMs themselves vs
// the CPU kernel: linear_cuda_test.
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "tests/kernels/cuda_kernel_test_util.h"
#include "worker/kernels/linear.h"
#include "worker/kernels/rms_norm.h"
#include "worker/kernels/rope_kv_cache.h"

namespace pdworker {
namespace kernels {
namespace {

using testing::CudaKernelTest;
using testing::RandomBf16Floats;
using testing::SameBits;

constexpr LinearKernel kSkinny = LinearKernel::kSkinnyGemm;
constexpr LinearKernel kMma = LinearKernel::kSkinnyMma;

std::string KernelName(LinearKernel kernel) {
  return kernel == kMma ? "skinny_mma" : "skinny_gemm";
}

// The decode-step fusions against the kernels they replace, bit for bit:
// an RMSNorm prologue == LaunchRmsNorm then the GEMM (with the SiLU-and-mul
// epilogue too), a residual-add epilogue == the GEMM then the residual
// update of LaunchFusedAddRmsNorm. Both skinny kernels (the CUDA-core one at
// one token, the tensor-core one at 1..8), the 0.5B / 1B shapes (qkv with
// its bias; 4,864 and 8,192-wide down inputs), a hidden size that is not a
// multiple of 256 (the norm's last vectors on some threads only), residuals
// of a wide range so the norm's scale matters. Outputs poisoned first.
TEST_F(CudaKernelTest,
       SkinnyGemmNormAndResidualFusionsMatchTheSeparateKernels) {
  struct Case {
    int hidden, out, inter;
    bool bias;
  };
  const float eps = 1e-5f;
  for (const LinearKernel kernel : {kSkinny, kMma}) {
    for (const Case& c :
         {Case{896, 1152, 4864, true}, Case{2048, 3072, 8192, false},
          Case{328, 200, 72, true}}) {
      for (int tokens = 1; tokens <= (kernel == kSkinny ? 1 : 8); ++tokens) {
        SCOPED_TRACE(absl::StrFormat("%s hidden %d tokens %d",
                                     KernelName(kernel), c.hidden, tokens));
        const std::vector<float> residual =
            RandomBf16Floats(tokens * c.hidden, 71, -8.0f, 8.0f);
        const DeviceBuffer residual_buffer = GpuBf16(residual);
        const DeviceBuffer norm_weight =
            GpuBf16(RandomBf16Floats(c.hidden, 72, 0.5f, 1.5f));
        const DeviceBuffer w_qkv =
            GpuBf16(RandomBf16Floats(c.out * c.hidden, 73));
        const DeviceBuffer bias =
            c.bias ? GpuBf16(RandomBf16Floats(c.out, 74)) : DeviceBuffer();
        const DeviceBuffer w_gate_up =
            GpuBf16(RandomBf16Floats(2 * c.inter * c.hidden, 75));
        const DeviceBuffer w_down =
            GpuBf16(RandomBf16Floats(c.hidden * c.inter, 76, -0.1f, 0.1f));
        auto poisoned = [&](int elements) {
          DeviceBuffer b = gpu().Alloc(2 * elements);
          gpu().Write(b, std::vector<uint16_t>(elements, 0xFFFF));
          return b;
        };

        // Unfused: normed = RMSNorm(residual); qkv = normed · Wᵀ + b;
        // act = silu_and_mul(normed · W_gate_upᵀ); delta = act · W_downᵀ;
        // residual' = residual + delta.
        const DeviceBuffer normed = poisoned(tokens * c.hidden);
        ASSERT_TRUE(LaunchRmsNorm(*gpu().stream,
                                  {residual_buffer, norm_weight, normed, tokens,
                                   c.hidden, eps, DType::kBFloat16})
                        .ok());
        LinearParams qkv{
            normed,           w_qkv,    bias,  poisoned(tokens * c.out),
            tokens,           c.hidden, c.out, DType::kBFloat16,
            DType::kBFloat16, kernel};
        ASSERT_TRUE(LaunchLinear(*gpu().stream, qkv).ok());
        LinearParams gate_up{normed,
                             w_gate_up,
                             DeviceBuffer(),
                             poisoned(tokens * c.inter),
                             tokens,
                             c.hidden,
                             2 * c.inter,
                             DType::kBFloat16,
                             DType::kBFloat16,
                             kernel,
                             LinearEpilogue::kSiluAndMul};
        ASSERT_TRUE(LaunchLinear(*gpu().stream, gate_up).ok());
        LinearParams down{gate_up.output,   w_down,
                          DeviceBuffer(),   poisoned(tokens * c.hidden),
                          tokens,           c.inter,
                          c.hidden,         DType::kBFloat16,
                          DType::kBFloat16, kernel};
        ASSERT_TRUE(LaunchLinear(*gpu().stream, down).ok());
        const DeviceBuffer updated = GpuBf16(residual);
        ASSERT_TRUE(LaunchFusedAddRmsNorm(*gpu().stream,
                                          {down.output, updated, norm_weight,
                                           poisoned(tokens * c.hidden), tokens,
                                           c.hidden, eps, DType::kBFloat16})
                        .ok());

        // Fused: the same three projections reading the residual.
        auto normalize = [&](LinearParams p) {
          p.input = residual_buffer;
          p.prologue = LinearPrologue::kRmsNorm;
          p.norm_weight = norm_weight;
          p.norm_epsilon = eps;
          p.output = poisoned(p.epilogue == LinearEpilogue::kSiluAndMul
                                  ? tokens * c.inter
                                  : tokens * c.out);
          return p;
        };
        const LinearParams fused_qkv = normalize(qkv);
        ASSERT_TRUE(LinearCanFuse(*gpu().stream, fused_qkv));
        ASSERT_TRUE(LaunchLinear(*gpu().stream, fused_qkv).ok());
        EXPECT_TRUE(SameBits(ReadGpuBf16(fused_qkv.output, tokens * c.out),
                             ReadGpuBf16(qkv.output, tokens * c.out)))
            << "qkv with the norm prologue";
        const LinearParams fused_gate_up = normalize(gate_up);
        ASSERT_TRUE(LinearCanFuse(*gpu().stream, fused_gate_up));
        ASSERT_TRUE(LaunchLinear(*gpu().stream, fused_gate_up).ok());
        EXPECT_TRUE(
            SameBits(ReadGpuBf16(fused_gate_up.output, tokens * c.inter),
                     ReadGpuBf16(gate_up.output, tokens * c.inter)))
            << "gate_up with the norm prologue and silu_and_mul";
        LinearParams fused_down = down;
        fused_down.output = GpuBf16(residual);
        fused_down.epilogue = LinearEpilogue::kAddResidual;
        ASSERT_TRUE(LinearCanFuse(*gpu().stream, fused_down));
        ASSERT_TRUE(LaunchLinear(*gpu().stream, fused_down).ok());
        const std::vector<float> want = ReadGpuBf16(updated, tokens * c.hidden);
        EXPECT_TRUE(
            SameBits(ReadGpuBf16(fused_down.output, tokens * c.hidden), want))
            << "down with the residual epilogue";
        // And the residual really moved (the epilogue did not just keep it).
        EXPECT_FALSE(SameBits(want, residual));
      }
    }
  }
}

// The qkv projection with the RoPE + KV-cache epilogue (alone, and after
// the RMSNorm prologue) against the projection followed by
// LaunchRopeKvCache, bit for bit: the rotated q and k and the untouched v
// in the qkv rows, and every byte of both caches (poisoned alike first):
// the slots written, a padding token's -1 slot and a slot past the cache
// skipped. Both skinny kernels; the 0.5B / 1B head layouts (14 / 32 heads
// over 2 / 8 kv heads, head_dim 64, qkv bias on the first) and head_dim
// 128; positions far apart so every frequency turns.
TEST_F(CudaKernelTest, SkinnyGemmRopeKvCacheEpilogueMatchesTheTwoKernels) {
  struct Case {
    int hidden, heads, kv_heads, head_dim;
    bool bias;
  };
  constexpr int kBlockSize = 16, kNumBlocks = 8;
  const float eps = 1e-6f;
  for (const LinearKernel kernel : {kSkinny, kMma}) {
    for (const Case& c :
         {Case{896, 14, 2, 64, true}, Case{2048, 32, 8, 64, false},
          Case{256, 4, 1, 128, false}}) {
      const int out = (c.heads + 2 * c.kv_heads) * c.head_dim;
      RopeConfig config;
      config.head_dim = c.head_dim;
      config.theta = 500000.0;
      const DeviceBuffer inv_freq = gpu().Upload(ComputeRopeInvFreq(config));
      const DeviceBuffer w = GpuBf16(RandomBf16Floats(out * c.hidden, 91));
      const DeviceBuffer bias =
          c.bias ? GpuBf16(RandomBf16Floats(out, 92)) : DeviceBuffer();
      const DeviceBuffer norm_weight =
          GpuBf16(RandomBf16Floats(c.hidden, 93, 0.5f, 1.5f));
      for (const LinearPrologue prologue :
           {LinearPrologue::kNone, LinearPrologue::kRmsNorm}) {
        for (int tokens = 1; tokens <= (kernel == kSkinny ? 1 : 8);
             tokens += 3) {
          SCOPED_TRACE(absl::StrFormat(
              "%s heads %d/%d d %d tokens %d%s", KernelName(kernel), c.heads,
              c.kv_heads, c.head_dim, tokens,
              prologue == LinearPrologue::kRmsNorm ? " with the norm" : ""));
          const std::vector<float> x =
              RandomBf16Floats(tokens * c.hidden, 94, -3.0f, 3.0f);
          const DeviceBuffer input = GpuBf16(x);
          std::vector<int32_t> positions(tokens), slots(tokens);
          for (int t = 0; t < tokens; ++t) {
            positions[t] = 1 + 977 * t;
            slots[t] = (t * 37 + 5) % (kBlockSize * kNumBlocks);
          }
          if (tokens > 1) slots[1] = -1;                           // padding
          if (tokens > 4) slots[4] = kBlockSize * kNumBlocks + 3;  // past it
          const int cache_elements =
              kNumBlocks * kBlockSize * c.kv_heads * c.head_dim;

          // Reference: [RMSNorm,] the projection, then the RoPE kernel.
          DeviceBuffer gemm_input = input;
          if (prologue == LinearPrologue::kRmsNorm) {
            gemm_input = gpu().Alloc(2 * tokens * c.hidden);
            ASSERT_TRUE(LaunchRmsNorm(*gpu().stream,
                                      {input, norm_weight, gemm_input, tokens,
                                       c.hidden, eps, DType::kBFloat16})
                            .ok());
          }
          auto rope_for = [&](DeviceBuffer qkv, DeviceBuffer key_cache,
                              DeviceBuffer value_cache) {
            const size_t q_bytes = 2 * c.heads * c.head_dim;
            const size_t kv_bytes = 2 * c.kv_heads * c.head_dim;
            RopeKvCacheParams r;
            r.positions = gpu().Upload(positions);
            r.slot_mapping = gpu().Upload(slots);
            r.inv_freq = inv_freq;
            r.query = qkv;
            r.key = qkv.Slice(q_bytes, qkv.size_bytes() - q_bytes);
            r.value = qkv.Slice(q_bytes + kv_bytes,
                                qkv.size_bytes() - q_bytes - kv_bytes);
            r.key_cache = key_cache;
            r.value_cache = value_cache;
            r.num_tokens = tokens;
            r.num_heads = c.heads;
            r.num_kv_heads = c.kv_heads;
            r.head_dim = c.head_dim;
            r.block_size = kBlockSize;
            r.num_blocks = kNumBlocks;
            r.query_row_stride = out;
            r.key_row_stride = out;
            r.value_row_stride = out;
            r.dtype = DType::kBFloat16;
            return r;
          };
          LinearParams p{
              gemm_input,       w,        bias, gpu().Alloc(2 * tokens * out),
              tokens,           c.hidden, out,  DType::kBFloat16,
              DType::kBFloat16, kernel};
          ASSERT_TRUE(LaunchLinear(*gpu().stream, p).ok());
          const RopeKvCacheParams want_rope =
              rope_for(p.output, gpu().Alloc(2 * cache_elements),
                       gpu().Alloc(2 * cache_elements));
          ASSERT_TRUE(LaunchRopeKvCache(*gpu().stream, want_rope).ok());

          LinearParams fused = p;
          fused.output = gpu().Alloc(2 * tokens * out);
          fused.epilogue = LinearEpilogue::kRopeKvCache;
          fused.rope = rope_for(fused.output, gpu().Alloc(2 * cache_elements),
                                gpu().Alloc(2 * cache_elements));
          if (prologue == LinearPrologue::kRmsNorm) {
            fused.input = input;
            fused.prologue = LinearPrologue::kRmsNorm;
            fused.norm_weight = norm_weight;
            fused.norm_epsilon = eps;
          }
          ASSERT_TRUE(LinearCanFuse(*gpu().stream, fused));
          ASSERT_TRUE(LaunchLinear(*gpu().stream, fused).ok());
          EXPECT_TRUE(SameBits(ReadGpuBf16(fused.output, tokens * out),
                               ReadGpuBf16(p.output, tokens * out)))
              << "qkv rows";
          const std::vector<float> want_k =
              ReadGpuBf16(want_rope.key_cache, cache_elements);
          EXPECT_TRUE(SameBits(
              ReadGpuBf16(fused.rope.key_cache, cache_elements), want_k))
              << "key cache";
          EXPECT_TRUE(
              SameBits(ReadGpuBf16(fused.rope.value_cache, cache_elements),
                       ReadGpuBf16(want_rope.value_cache, cache_elements)))
              << "value cache";
          // Something was written (not NaN poison everywhere).
          int written = 0;
          for (const float v : want_k) written += v == v;
          EXPECT_GT(written, 0);
        }
      }
    }
  }
}

// The RoPE epilogue is refused when `rope` does not describe the output
// (another buffer's rows, a wrong stride), when the head layout does not
// add up to out_features, and on cuBLAS.
TEST_F(CudaKernelTest, RopeKvCacheEpilogueIsRefusedWhenItDoesNotFit) {
  const int hidden = 64, heads = 2, kv_heads = 1, d = 16;
  const int out = (heads + 2 * kv_heads) * d;
  RopeConfig config;
  config.head_dim = d;
  LinearParams p{GpuBf16(RandomBf16Floats(hidden, 95)),
                 GpuBf16(RandomBf16Floats(out * hidden, 96)),
                 DeviceBuffer(),
                 gpu().Alloc(2 * out),
                 1,
                 hidden,
                 out,
                 DType::kBFloat16,
                 DType::kBFloat16,
                 LinearKernel::kAuto,
                 LinearEpilogue::kRopeKvCache};
  RopeKvCacheParams& r = p.rope;
  r.positions = gpu().Upload(std::vector<int32_t>{3});
  r.slot_mapping = gpu().Upload(std::vector<int32_t>{0});
  r.inv_freq = gpu().Upload(ComputeRopeInvFreq(config));
  r.query = p.output;
  r.key = p.output.Slice(2 * heads * d, 2 * (out - heads * d));
  r.value = p.output.Slice(2 * (heads + kv_heads) * d, 2 * kv_heads * d);
  r.key_cache = gpu().Alloc(2 * 4 * kv_heads * d);
  r.value_cache = gpu().Alloc(2 * 4 * kv_heads * d);
  r.num_tokens = 1;
  r.num_heads = heads;
  r.num_kv_heads = kv_heads;
  r.head_dim = d;
  r.block_size = 4;
  r.num_blocks = 1;
  r.query_row_stride = out;
  r.key_row_stride = out;
  r.value_row_stride = out;
  r.dtype = DType::kBFloat16;
  ASSERT_TRUE(LinearCanFuse(*gpu().stream, p));
  ASSERT_TRUE(LaunchLinear(*gpu().stream, p).ok());
  auto refused = [&](const LinearParams& bad, const char* why) {
    SCOPED_TRACE(why);
    const absl::Status status = LaunchLinear(*gpu().stream, bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), ::testing::HasSubstr("rope_kv_cache"));
  };
  LinearParams bad = p;
  bad.rope.query = gpu().Alloc(2 * out);
  refused(bad, "rope.query is another buffer");
  bad = p;
  bad.rope.key_row_stride = 0;  // dense: not the fused rows
  refused(bad, "key stride");
  bad = p;
  bad.kernel = LinearKernel::kCublas;
  EXPECT_FALSE(LinearCanFuse(*gpu().stream, bad));
  refused(bad, "cuBLAS");
  bad = p;
  bad.rope.num_kv_heads = 2;  // 2 + 2 * 2 heads of 16 != out_features
  bad.rope.key_cache = gpu().Alloc(2 * 4 * 2 * d);
  bad.rope.value_cache = gpu().Alloc(2 * 4 * 2 * d);
  bad.rope.value = p.output;
  refused(bad, "head layout");
}

// Fusions a kernel cannot run are refused, naming the fusion, and
// LinearCanFuse says so beforehand: cuBLAS (kAuto at two tokens on a layer
// wider than 4,096 outputs; on a narrow one it runs the tensor-core kernel,
// which fuses), the CUDA-core kernel above one token, a prologue whose
// normalized rows exceed the shared memory budget, a prologue with the residual
// epilogue, fp32 output, a norm_weight too short (named).
TEST_F(CudaKernelTest, NormAndResidualFusionsAreRefusedWhereTheyCannotRun) {
  const int hidden = 4096, out = 64;
  LinearParams p{GpuBf16(RandomBf16Floats(8 * hidden, 81)),
                 GpuBf16(RandomBf16Floats(out * hidden, 82)),
                 DeviceBuffer(),
                 gpu().Alloc(4 * 8 * out),
                 1,
                 hidden,
                 out,
                 DType::kBFloat16,
                 DType::kBFloat16};
  p.prologue = LinearPrologue::kRmsNorm;
  p.norm_weight = GpuBf16(RandomBf16Floats(hidden, 83, 0.5f, 1.5f));
  p.norm_epsilon = 1e-6f;
  ASSERT_TRUE(LinearCanFuse(*gpu().stream, p));  // kAuto, one token
  ASSERT_TRUE(LaunchLinear(*gpu().stream, p).ok());
  auto refused = [&](LinearParams bad, const char* fusion, const char* why) {
    SCOPED_TRACE(why);
    EXPECT_FALSE(LinearCanFuse(*gpu().stream, bad));
    const absl::Status status = LaunchLinear(*gpu().stream, bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), ::testing::HasSubstr(fusion));
  };
  LinearParams two = p;
  two.num_tokens = 2;
  EXPECT_TRUE(LinearCanFuse(*gpu().stream, two));  // kAuto: tensor cores
  EXPECT_TRUE(LaunchLinear(*gpu().stream, two).ok());
  LinearParams bad = two;
  bad.out_features = 8192;
  bad.weight = GpuBf16(RandomBf16Floats(8192 * hidden, 85));
  bad.output = gpu().Alloc(2 * 2 * 8192);
  refused(bad, "prologue rms_norm", "kAuto at two tokens, wide: cuBLAS");
  bad = two;
  bad.kernel = kSkinny;
  refused(bad, "prologue rms_norm", "CUDA-core kernel at two tokens");
  bad.kernel = kMma;
  bad.num_tokens = 5;  // 5 · 4104 · 2 bytes > 36 KiB
  refused(bad, "prologue rms_norm", "normalized rows beyond shared memory");
  bad = p;
  bad.epilogue = LinearEpilogue::kAddResidual;
  refused(bad, "add_residual", "prologue with the residual epilogue");
  bad = p;
  bad.output_dtype = DType::kFloat32;
  refused(bad, "prologue rms_norm", "fp32 output");
  bad = p;
  bad.prologue = LinearPrologue::kNone;
  bad.epilogue = LinearEpilogue::kAddResidual;
  bad.kernel = LinearKernel::kCublas;
  refused(bad, "add_residual", "cuBLAS");
  bad = p;
  bad.norm_weight = GpuBf16(RandomBf16Floats(hidden - 8, 84));
  const absl::Status status = LaunchLinear(*gpu().stream, bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("'norm_weight'"));
}

}  // namespace
}  // namespace kernels
}  // namespace pdworker
