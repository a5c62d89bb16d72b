// The Llama forward on CUDA (tag "gpu"), below the model runner so that the
// padded shape can be held fixed:
//  - every graph mode (FULL, PIECEWISE; capture run and later replays) gives
//    the same bits as an eager run of the same padded batch descriptor, for
//    logits and the whole KV cache, and a graph captured for one batch serves
//    later batches of the same key bit-identically to eager;
//  - padding tokens and padding requests never write the KV cache, and
//    padding requests get zero logits.
// (Across different padded shapes cuBLAS may pick other algorithms, so
// eager-unpadded vs graph-padded is only compared within tolerance, in
// model_runner_gpu_test.)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/runner/model_runner_test_util.h"
#include "worker/kv_cache/kv_cache_manager.h"
#include "worker/model/checkpoint.h"
#include "worker/model/llama_forward.h"
#include "worker/model/llama_weights.h"
#include "worker/model/model_config.h"
#include "worker/runner/step_inputs.h"
#include "worker/runtime/device_factory.h"

namespace pdworker {
namespace {

using runner_testing::TinyModelDir;

constexpr int kMaxNumSeqs = 8;
constexpr int kMaxTokens = 64;
constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 128;
constexpr int kMaxModelLen = 128;
constexpr int kMaxBlocksPerSeq = kMaxModelLen / kBlockSize;
constexpr uint8_t kKvPoison = 0xAB;

struct SeqTokens {
  std::string id;
  std::vector<int32_t> tokens;
};

// Everything the runner would own, built by hand on a CUDA device.
class ForwardGpuTest : public ::testing::TestWithParam<TinyShape> {
 protected:
  void SetUp() override {
    auto device = CreateDevice(DeviceKind::kCuda);
    if (!device.ok()) {
      GTEST_SKIP() << "CUDA backend not available here ("
                   << device.status().message()
                   << "); run the gpu-tagged targets on a GPU machine";
    }
    device_ = *std::move(device);
    auto dir = TinyModelDir(GetParam());
    ASSERT_TRUE(dir.ok()) << dir.status();
    auto config = LoadModelConfig(*dir);
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    auto stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
    auto checkpoint = Checkpoint::Open(*dir);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    auto weights = LoadLlamaWeights(config_, **checkpoint, *device_, *stream_);
    ASSERT_TRUE(weights.ok()) << weights.status();
    weights_ = *std::move(weights);
    ASSERT_EQ(weights_.dtype, DType::kBFloat16);

    auto arena = Arena::Create(*device_, {size_t{1} << 20, 256, "step"});
    ASSERT_TRUE(arena.ok()) << arena.status();
    step_arena_ = *std::move(arena);
    auto inputs = StepInputs::Create(
        *device_, *step_arena_, {kMaxNumSeqs, kMaxTokens, kMaxBlocksPerSeq, 1},
        kBlockSize);
    ASSERT_TRUE(inputs.ok()) << inputs.status();
    inputs_ = *std::move(inputs);

    LlamaForwardOptions options;
    options.max_num_tokens = kMaxTokens;
    options.max_num_seqs = kMaxNumSeqs;
    options.block_size = kBlockSize;
    options.num_blocks = kNumBlocks;
    options.max_blocks_per_seq = kMaxBlocksPerSeq;
    options.input_address_check = InputAddressCheck::kOn;
    // Qwen3's q/k norm and partial rotary: their first GPU run is here.
    options.kernel_options.unverified_cuda_kernels =
        UnverifiedCudaKernels::kAllow;
    auto forward =
        LlamaForward::Create(config_, weights_, inputs_->buffers(), options,
                             *device_, *stream_, capture_lifecycle_);
    ASSERT_TRUE(forward.ok()) << forward.status();
    forward_ = *std::move(forward);
    kv_ =
        std::make_unique<KvCacheManager>(kNumBlocks, kBlockSize, kMaxModelLen);
    // Known bytes everywhere, so unwritten blocks can be recognized.
    for (int l = 0; l < config_.num_hidden_layers; ++l) {
      for (const DeviceBuffer& b :
           {forward_->key_caches()[l], forward_->value_caches()[l]}) {
        const std::vector<uint8_t> poison(b.size_bytes(), kKvPoison);
        ASSERT_TRUE(
            stream_->CopyToDevice(b, poison.data(), poison.size()).ok());
      }
    }
  }

  // Appends `seqs` to the KV cache and writes the step's inputs, padded to
  // `shape`, into the static buffers.
  void Prepare(const std::vector<SeqTokens>& seqs, const PaddedShape& shape) {
    std::vector<SequenceAppend> appends;
    for (const SeqTokens& s : seqs) {
      appends.push_back({s.id, static_cast<int32_t>(s.tokens.size()),
                         SequenceCreation::kCreateIfMissing});
    }
    ASSERT_TRUE(kv_->Append(appends).ok());
    std::vector<StepSequence> steps;
    for (const SeqTokens& s : seqs) {
      steps.push_back({kv_->Find(s.id), s.tokens});
    }
    ASSERT_TRUE(inputs_->Build(steps, shape).ok());
    ASSERT_TRUE(inputs_->Upload(*stream_).ok());
  }

  struct Output {
    std::vector<float> logits;
    std::vector<std::vector<uint8_t>> kv;  // per layer: K, then V
  };

  // Runs the forward for `context`, then reads logits and the KV cache.
  Output Run(const ForwardContext& context) {
    Output out;
    const absl::Status status = forward_->Run(context);
    EXPECT_TRUE(status.ok()) << context.ToString() << ": " << status;
    out.logits.resize(static_cast<size_t>(forward_->LogitsRows(context)) *
                      config_.vocab_size);
    EXPECT_TRUE(stream_
                    ->CopyToHost(out.logits.data(), forward_->logits(),
                                 out.logits.size() * sizeof(float))
                    .ok());
    for (int l = 0; l < config_.num_hidden_layers; ++l) {
      for (const DeviceBuffer& b :
           {forward_->key_caches()[l], forward_->value_caches()[l]}) {
        std::vector<uint8_t> bytes(b.size_bytes());
        EXPECT_TRUE(stream_->CopyToHost(bytes.data(), b, bytes.size()).ok());
        out.kv.push_back(std::move(bytes));
      }
    }
    return out;
  }

  // Eager at `descriptor`, then each graph mode: the capture run (inside the
  // capture window) and a replay; all must equal eager bit for bit.
  void ExpectModesBitIdentical(const BatchDescriptor& descriptor,
                               const std::vector<RuntimeMode>& modes,
                               const std::string& what) {
    const Output eager = Run({RuntimeMode::kNone, descriptor});
    for (float v : eager.logits) ASSERT_TRUE(std::isfinite(v)) << what;
    for (const RuntimeMode mode : modes) {
      for (int call = 0; call < 2; ++call) {
        Output graph;
        if (call == 0) {
          CaptureLifecycle::CaptureWindow scope(capture_lifecycle_);
          graph = Run({mode, descriptor});
        } else {
          graph = Run({mode, descriptor});
        }
        const std::string label = what + " " +
                                  std::string(RuntimeModeName(mode)) +
                                  (call == 0 ? " (capture run)" : " (replay)");
        ASSERT_EQ(graph.logits.size(), eager.logits.size()) << label;
        EXPECT_EQ(std::memcmp(graph.logits.data(), eager.logits.data(),
                              eager.logits.size() * sizeof(float)),
                  0)
            << label << ": logits differ from eager";
        ASSERT_EQ(graph.kv.size(), eager.kv.size());
        for (size_t i = 0; i < eager.kv.size(); ++i) {
          EXPECT_TRUE(graph.kv[i] == eager.kv[i])
              << label << ": KV cache " << i << " differs from eager";
        }
      }
    }
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  ModelConfig config_;
  LlamaWeights weights_;
  std::unique_ptr<Arena> step_arena_;
  std::unique_ptr<StepInputs> inputs_;
  CaptureLifecycle capture_lifecycle_;
  std::unique_ptr<LlamaForward> forward_;
  std::unique_ptr<KvCacheManager> kv_;
};

TEST_P(ForwardGpuTest, EveryModeIsBitIdenticalToEagerAtThePaddedShape) {
  const auto F = RuntimeMode::kFull;
  const auto P = RuntimeMode::kPiecewise;
  // Prefill of two prompts, 10 tokens padded to a mixed key of 16.
  Prepare({{"a", {5, 17, 42, 8, 99, 3, 61}}, {"b", {1, 2, 3}}}, {16, 2, 0});
  ExpectModesBitIdentical({16, 0, false}, {P, F}, "prefill 10->16");
  // Uniform decode of 3 requests padded to a key of 4 (one padding
  // request): FULL at the uniform key (split-K decode routine), PIECEWISE at
  // the relaxed key (varlen routine), each against eager at its descriptor.
  Prepare({{"a", {12}}, {"b", {77}}, {"c", {9}}}, {4, 4, 1});
  ExpectModesBitIdentical({4, 4, true}, {F}, "decode 3->4, uniform key");
  Prepare({{"a", {13}}, {"b", {78}}, {"c", {10}}}, {4, 3, 0});
  ExpectModesBitIdentical({4, 0, false}, {P}, "decode 3->4, relaxed key");
  // Mixed: a decode plus a prompt chunk, 6 tokens padded to 8.
  Prepare({{"a", {7}}, {"d", {150, 9, 44, 21, 33}}}, {8, 2, 0});
  ExpectModesBitIdentical({8, 0, false}, {P, F}, "mixed 6->8");
}

// The graph of a uniform decode key captured for one batch serves a later
// batch with other lengths and block tables exactly like eager.
TEST_P(ForwardGpuTest, OneDecodeGraphServesLaterStepsBitIdentically) {
  Prepare({{"a", {5, 17, 42, 8}}, {"b", {1, 2}}}, {8, 2, 0});
  ASSERT_TRUE(forward_->Run({RuntimeMode::kNone, {8, 0, false}}).ok());
  const BatchDescriptor key{4, 4, true};
  {
    Prepare({{"a", {12}}, {"b", {77}}}, {4, 4, 1});
    // Warm-up, as the capture session does: kernel modules load lazily and
    // cuBLAS picks its algorithms outside the capture.
    ASSERT_TRUE(forward_->Run({RuntimeMode::kNone, key}).ok());
    CaptureLifecycle::CaptureWindow scope(capture_lifecycle_);
    ASSERT_TRUE(forward_->Run({RuntimeMode::kFull, key}).ok());
  }
  ASSERT_EQ(forward_->full_wrapper().num_graphs(), 1u);
  // Later steps: more requests, longer contexts, a fresh sequence.
  std::vector<int32_t> prompt(30);
  for (int i = 0; i < 30; ++i) prompt[i] = 3 * i + 1;
  Prepare({{"c", prompt}}, {32, 1, 0});
  ASSERT_TRUE(forward_->Run({RuntimeMode::kNone, {32, 0, false}}).ok());
  for (int step = 0; step < 3; ++step) {
    Prepare({{"a", {20 + step}}, {"b", {30 + step}}, {"c", {40 + step}}},
            {4, 4, 1});
    const Output replayed = Run({RuntimeMode::kFull, key});
    const Output eager = Run({RuntimeMode::kNone, key});
    EXPECT_EQ(std::memcmp(replayed.logits.data(), eager.logits.data(),
                          eager.logits.size() * sizeof(float)),
              0)
        << "step " << step;
    EXPECT_TRUE(replayed.kv == eager.kv) << "step " << step;
  }
  EXPECT_EQ(forward_->full_wrapper().num_graphs(), 1u);
}

// Padding tokens (slot -1) and padding requests (seq_len 0) write nothing:
// every block no sequence owns still holds the poison bytes after padded
// graph steps, and padding requests' logits rows are zero.
TEST_P(ForwardGpuTest, PaddingNeverWritesKvAndGetsZeroLogits) {
  Prepare({{"a", {5, 17, 42}}, {"b", {1, 2, 3, 4, 5}}}, {16, 2, 0});
  ASSERT_TRUE(forward_->Run({RuntimeMode::kNone, {16, 0, false}}).ok());
  {
    CaptureLifecycle::CaptureWindow scope(capture_lifecycle_);
    ASSERT_TRUE(forward_->Run({RuntimeMode::kFull, {16, 0, false}}).ok());
  }
  Prepare({{"a", {6}}, {"b", {7}}}, {8, 8, 1});  // 6 padding requests
  ASSERT_TRUE(forward_->Run({RuntimeMode::kNone, {8, 8, true}}).ok());
  Output out;
  {
    CaptureLifecycle::CaptureWindow scope(capture_lifecycle_);
    out = Run({RuntimeMode::kFull, {8, 8, true}});
  }
  const size_t vocab = config_.vocab_size;
  for (size_t i = 2 * vocab; i < out.logits.size(); ++i) {
    ASSERT_EQ(out.logits[i], 0.0f) << "padding request logits, element " << i;
  }
  std::vector<bool> owned(kNumBlocks, false);
  for (const char* id : {"a", "b"}) {
    for (int32_t b : kv_->Find(id)->blocks) owned[b] = true;
  }
  const size_t block_bytes = static_cast<size_t>(kBlockSize) *
                             config_.kv_size() * DTypeSize(DType::kBFloat16);
  int checked = 0;
  for (const auto& layer : out.kv) {
    ASSERT_EQ(layer.size(), block_bytes * kNumBlocks);
    for (int b = 0; b < kNumBlocks; ++b) {
      if (owned[b]) continue;
      const uint8_t* p = layer.data() + b * block_bytes;
      for (size_t i = 0; i < block_bytes; ++i) {
        ASSERT_EQ(p[i], kKvPoison) << "free block " << b << " was written";
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(AllShapes, ForwardGpuTest,
                         ::testing::ValuesIn(AllTinyShapes()),
                         [](const ::testing::TestParamInfo<TinyShape>& info) {
                           return std::string(TinyShapeName(info.param));
                         });

}  // namespace
}  // namespace pdworker
