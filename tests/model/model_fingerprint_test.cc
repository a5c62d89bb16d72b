// The model fingerprint identifies the weights, not only config.json: real
// safetensors checkpoints written to temp dirs, compared by their digests.
#include "worker/model/model_fingerprint.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/command.h"
#include "tests/model/test_paths.h"
#include "tools/make_tiny_model/tiny_model.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"
#include "worker/model/safetensors_writer.h"

namespace pdworker {
namespace {

using Json = nlohmann::json;

std::string WriteModel(uint64_t seed, int shards = 1,
                       DType dtype = DType::kFloat32) {
  const std::string dir = model_testing::MakeUniqueTempDir(
      absl::StrCat("fingerprint_seed", seed, "_", shards));
  TinyModelOptions options;
  options.shape = TinyShape::kGqa;
  options.seed = seed;
  options.num_shards = shards;
  options.dtype = dtype;
  const absl::Status status = WriteTinyModel(options, dir);
  EXPECT_TRUE(status.ok()) << status;
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string Digest(const std::string& dir) {
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return "";
  auto digest = WeightsDigest(**checkpoint);
  EXPECT_TRUE(digest.ok()) << digest.status();
  return digest.ok() ? *digest : "";
}

// The fingerprint a worker serving `dir` publishes.
std::string Fingerprint(const std::string& dir) {
  auto config = LoadModelConfig(dir);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return "";
  auto fingerprint = ModelFingerprint(*config, Digest(dir));
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
  return fingerprint.ok() ? *fingerprint : "";
}

bool IsLowerHex(const std::string& text, size_t length) {
  if (text.size() != length) return false;
  for (const char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Where tensor `name`'s bytes start in a single-file checkpoint, and how
// many there are, read from the file's own header.
struct ByteRange {
  int64_t begin = 0;
  int64_t size = 0;
};
ByteRange TensorBytesInFile(const std::string& file, const std::string& name) {
  const std::string bytes = ReadFile(file);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) {
    header_size = (header_size << 8) | static_cast<uint8_t>(bytes[i]);
  }
  const Json header = Json::parse(bytes.substr(8, header_size));
  const Json& offsets = header.at(name).at("data_offsets");
  const int64_t data_start = 8 + static_cast<int64_t>(header_size);
  return {data_start + offsets[0].get<int64_t>(),
          offsets[1].get<int64_t>() - offsets[0].get<int64_t>()};
}

void FlipByte(const std::string& file, int64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.is_open()) << file;
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x01));
  ASSERT_TRUE(f.good()) << file << " at " << offset;
}

TEST(ModelFingerprintTest, SameConfigDifferentWeightsDiffer) {
  const std::string base = WriteModel(7);
  const std::string tuned = WriteModel(8);
  // config.json is byte-for-byte the same, so the shape fingerprint agrees:
  // only the weights can tell the two apart.
  ASSERT_EQ(ReadFile(base + "/config.json"), ReadFile(tuned + "/config.json"));
  auto base_config = LoadModelConfig(base);
  auto tuned_config = LoadModelConfig(tuned);
  ASSERT_TRUE(base_config.ok() && tuned_config.ok());
  ASSERT_EQ(base_config->Fingerprint(), tuned_config->Fingerprint());

  const std::string base_digest = Digest(base);
  EXPECT_TRUE(IsLowerHex(base_digest, 64)) << base_digest;
  EXPECT_NE(base_digest, Digest(tuned));
  const std::string base_fingerprint = Fingerprint(base);
  EXPECT_TRUE(IsLowerHex(base_fingerprint, 64)) << base_fingerprint;
  EXPECT_NE(base_fingerprint, Fingerprint(tuned));
  // Stable: the same directory hashes the same every time.
  EXPECT_EQ(base_fingerprint, Fingerprint(base));
}

TEST(ModelFingerprintTest, SameWeightsElsewhereOrReshardedAreEqual) {
  const std::string original = WriteModel(7);
  const std::string copy = model_testing::MakeUniqueTempDir("fingerprint_copy");
  std::filesystem::copy(original, copy,
                        std::filesystem::copy_options::overwrite_existing |
                            std::filesystem::copy_options::recursive);
  EXPECT_EQ(Fingerprint(copy), Fingerprint(original));
  // The same values in three shards (other files, other offsets).
  const std::string sharded = WriteModel(7, 3);
  EXPECT_EQ(Digest(sharded), Digest(original));
  // Stored as bf16 the bytes differ, so the weights do too.
  EXPECT_NE(Digest(WriteModel(7, 1, DType::kBFloat16)), Digest(original));
}

// Every byte counts: the first, a middle and the last byte of a tensor's
// data, in the largest and in a tiny (norm) tensor.
TEST(ModelFingerprintTest, OneChangedByteChangesIt) {
  const std::string original = WriteModel(7);
  const std::string reference = Fingerprint(original);
  for (const char* tensor :
       {"model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"}) {
    const std::string dir =
        model_testing::MakeUniqueTempDir("fingerprint_flip");
    std::filesystem::copy(original, dir,
                          std::filesystem::copy_options::recursive);
    const std::string path = dir + "/model.safetensors";
    const ByteRange range = TensorBytesInFile(path, tensor);
    ASSERT_GT(range.size, 2);
    for (const int64_t at : {range.begin, range.begin + range.size / 2 + 1,
                             range.begin + range.size - 1}) {
      FlipByte(path, at);
      EXPECT_NE(Fingerprint(dir), reference)
          << tensor << " byte " << at - range.begin;
      FlipByte(path, at);  // back: the fingerprint is the original again
      EXPECT_EQ(Fingerprint(dir), reference)
          << tensor << " byte " << at - range.begin;
    }
  }
}

// What a header contributes: names, dtypes and shapes count; tensor order
// in the file, offsets and __metadata__ do not.
TEST(ModelFingerprintTest, HeaderFieldsThatCount) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {0.5f, -1, 8};
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const std::vector<float>* values;
  };
  auto digest_of = [](std::vector<Tensor> tensors, std::string metadata) {
    SafetensorsWriter writer;
    for (const Tensor& t : tensors) {
      EXPECT_TRUE(writer.Add(t.name, t.dtype, t.shape, *t.values).ok());
    }
    writer.SetMetadata("format", metadata);
    const std::string dir =
        model_testing::MakeUniqueTempDir("fingerprint_header");
    EXPECT_TRUE(writer.WriteToFile(dir + "/model.safetensors").ok());
    return Digest(dir);
  };
  const Tensor x{"x", DType::kFloat32, {2, 3}, &a};
  const Tensor y{"y", DType::kFloat32, {3}, &b};
  const std::string reference = digest_of({x, y}, "pt");
  EXPECT_EQ(digest_of({y, x}, "pt"), reference);  // other order and offsets
  EXPECT_EQ(digest_of({x, y}, "np"), reference);  // other metadata

  Tensor renamed = x;
  renamed.name = "x2";
  EXPECT_NE(digest_of({renamed, y}, "pt"), reference);
  Tensor reshaped = x;  // same bytes, other shape
  reshaped.shape = {3, 2};
  EXPECT_NE(digest_of({reshaped, y}, "pt"), reference);
  Tensor half = x;  // same values, other dtype
  half.dtype = DType::kBFloat16;
  EXPECT_NE(digest_of({half, y}, "pt"), reference);
  EXPECT_NE(digest_of({x}, "pt"), reference);  // a tensor fewer
}

// A checkpoint whose tensors span several digest chunks: "big" is 2 chunks
// and 1 float (its last leaf 4 bytes), "exact" exactly one chunk, "small"
// under one. Values depend on `seed` only.
std::string WriteMultiChunkModel(uint64_t seed) {
  constexpr size_t kChunkFloats = kWeightsDigestChunkBytes / sizeof(float);
  auto values = [seed](size_t n, uint64_t salt) {
    std::vector<float> v(n);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + salt;
    for (float& f : v) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      f = static_cast<float>(static_cast<int32_t>(x >> 40)) * 1e-6f;
    }
    return v;
  };
  const std::vector<float> big = values(2 * kChunkFloats + 1, 1);
  const std::vector<float> exact = values(kChunkFloats, 2);
  const std::vector<float> small = values(5, 3);
  SafetensorsWriter writer;
  EXPECT_TRUE(
      writer
          .Add("big", DType::kFloat32, {static_cast<int64_t>(big.size())}, big)
          .ok());
  EXPECT_TRUE(writer
                  .Add("exact", DType::kFloat32,
                       {2, static_cast<int64_t>(kChunkFloats / 2)}, exact)
                  .ok());
  EXPECT_TRUE(writer.Add("small", DType::kFloat32, {5}, small).ok());
  const std::string dir = model_testing::MakeUniqueTempDir("fingerprint_tree");
  EXPECT_TRUE(writer.WriteToFile(dir + "/model.safetensors").ok());
  return dir;
}

std::string DigestWithThreads(const std::string& dir, int threads) {
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return "";
  auto digest = WeightsDigest(**checkpoint, threads);
  EXPECT_TRUE(digest.ok()) << digest.status();
  return digest.ok() ? *digest : "";
}

// The tree does not depend on how many threads hash its leaves.
TEST(ModelFingerprintTest, SameDigestOnAnyNumberOfThreads) {
  const std::string dir = WriteMultiChunkModel(7);
  const std::string reference = DigestWithThreads(dir, 1);
  EXPECT_TRUE(IsLowerHex(reference, 64)) << reference;
  for (const int threads : {0, 2, 3, 16}) {
    EXPECT_EQ(DigestWithThreads(dir, threads), reference) << threads;
  }
  EXPECT_NE(DigestWithThreads(WriteMultiChunkModel(8), 2), reference);
}

// A changed byte in any leaf (first, middle or last chunk of a tensor, on
// both sides of a chunk boundary) changes the digest.
TEST(ModelFingerprintTest, ChangedByteInAnyChunkChangesIt) {
  const std::string dir = WriteMultiChunkModel(7);
  const std::string path = dir + "/model.safetensors";
  const std::string reference = DigestWithThreads(dir, 2);
  const int64_t chunk = static_cast<int64_t>(kWeightsDigestChunkBytes);
  for (const char* tensor : {"big", "exact", "small"}) {
    const ByteRange range = TensorBytesInFile(path, tensor);
    std::vector<int64_t> offsets = {0, range.size - 1};
    for (int64_t boundary = chunk; boundary < range.size; boundary += chunk) {
      offsets.push_back(boundary - 1);
      offsets.push_back(boundary);
    }
    for (const int64_t at : offsets) {
      FlipByte(path, range.begin + at);
      EXPECT_NE(DigestWithThreads(dir, 2), reference) << tensor << " " << at;
      FlipByte(path, range.begin + at);
    }
  }
  EXPECT_EQ(DigestWithThreads(dir, 2), reference);
}

// The digest is the one model_fingerprint.h specifies: an independent
// implementation of the spec (tools/weights_digest: Python's hashlib and
// xxhash) agrees on a multi-chunk checkpoint and on a sharded tiny model.
TEST(ModelFingerprintTest, MatchesTheSpecsPythonImplementation) {
  for (const std::string& dir : {WriteMultiChunkModel(7), WriteModel(7, 3)}) {
    absl::StatusOr<std::string> python = model_testing::RunCommand(absl::StrCat(
        "/usr/bin/python3 ",
        model_testing::RunfilePath("tools/weights_digest/weights_digest.py"),
        " ", dir));
    ASSERT_TRUE(python.ok()) << python.status();
    EXPECT_EQ(std::string(absl::StripTrailingAsciiWhitespace(*python)),
              Digest(dir))
        << dir;
  }
}

TEST(ModelFingerprintTest, CombinesShapeAndWeights) {
  auto config = LoadModelConfig(WriteModel(7));
  ASSERT_TRUE(config.ok()) << config.status();
  const std::string digest(64, 'a');
  auto reference = ModelFingerprint(*config, digest);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(*ModelFingerprint(*config, digest), *reference);
  EXPECT_NE(*ModelFingerprint(*config, std::string(64, 'b')), *reference);
  ModelConfig other_shape = *config;
  other_shape.rope_theta *= 2;
  EXPECT_NE(*ModelFingerprint(other_shape, digest), *reference);
  // Fields the shape fingerprint leaves out stay out.
  ModelConfig other_tokens = *config;
  other_tokens.max_position_embeddings *= 2;
  other_tokens.eos_token_ids = {1, 2};
  EXPECT_EQ(*ModelFingerprint(other_tokens, digest), *reference);
}

}  // namespace
}  // namespace pdworker
