// SafetensorsFile: writer -> reader round trips for every dtype, exact bit
// patterns, and a table of malformed files that must all be clean errors
// (this test also runs under --config=asan).
#include "worker/model/safetensors.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/model/test_paths.h"
#include "worker/model/safetensors_writer.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

std::string WriteBytes(const std::string& bytes, const std::string& name) {
  std::string path =
      absl::StrCat(model_testing::MakeUniqueTempDir("safetensors"), "/", name);
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  EXPECT_TRUE(file.good());
  return path;
}

std::string Uint64Le(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(value >> (8 * i));
  return out;
}

std::vector<float> ReadOrDie(const SafetensorsFile& file,
                             const std::string& name) {
  std::vector<float> values;
  const absl::Status status = file.ReadAsFloat32(name, &values);
  EXPECT_TRUE(status.ok()) << status;
  return values;
}

// Values exactly representable in float32, float16 and bfloat16 alike.
const std::vector<float>& CommonValues() {
  static const std::vector<float> values = {0.0f,
                                            -0.0f,
                                            1.0f,
                                            -2.0f,
                                            0.5f,
                                            0.15625f,
                                            3.0f,
                                            -96.0f,
                                            0.0078125f,
                                            std::ldexp(1.0f, -14),
                                            -std::ldexp(3.0f, -10),
                                            448.0f};
  return values;
}

class RoundTripTest : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTripTest, RepresentableValuesAreExact) {
  const DType dtype = GetParam();
  const std::vector<float>& values = CommonValues();
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("matrix", dtype, {3, 4}, values).ok());
  ASSERT_TRUE(writer.Add("scalar", dtype, {}, {7.0f}).ok());
  ASSERT_TRUE(writer.Add("empty", dtype, {0, 5}, {}).ok());
  ASSERT_TRUE(
      writer.Add("f32_neighbour", DType::kFloat32, {2}, {1.5f, -4.0f}).ok());
  writer.SetMetadata("format", "pt");
  const std::string path = WriteBytes(writer.Serialize(), "rt.safetensors");

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& tensors = (*file)->tensors();
  ASSERT_EQ(tensors.size(), 4u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");

  const TensorInfo& matrix = tensors.at("matrix");
  EXPECT_EQ(matrix.dtype, dtype);
  EXPECT_EQ(matrix.shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(matrix.NumElements(), 12);
  EXPECT_EQ(matrix.bytes.size(), 12 * DTypeSize(dtype));
  const std::vector<float> read = ReadOrDie(**file, "matrix");
  ASSERT_EQ(read.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    // Bitwise: -0.0 must stay -0.0.
    uint32_t a, b;
    std::memcpy(&a, &read[i], 4);
    std::memcpy(&b, &values[i], 4);
    EXPECT_EQ(a, b) << "element " << i << ": " << read[i] << " vs "
                    << values[i];
  }

  EXPECT_TRUE(tensors.at("scalar").shape.empty());
  EXPECT_EQ(ReadOrDie(**file, "scalar"), std::vector<float>{7.0f});
  EXPECT_EQ(tensors.at("empty").NumElements(), 0);
  EXPECT_TRUE(ReadOrDie(**file, "empty").empty());
  EXPECT_EQ(ReadOrDie(**file, "f32_neighbour"),
            (std::vector<float>{1.5f, -4.0f}));
}

TEST_P(RoundTripTest, SpecialValuesSurvive) {
  const DType dtype = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  SafetensorsWriter writer;
  ASSERT_TRUE(writer
                  .Add("special", dtype, {3},
                       {inf, -inf, std::numeric_limits<float>::quiet_NaN()})
                  .ok());
  auto file = SafetensorsFile::Open(WriteBytes(writer.Serialize(), "special"));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float> read = ReadOrDie(**file, "special");
  ASSERT_EQ(read.size(), 3u);
  EXPECT_EQ(read[0], inf);
  EXPECT_EQ(read[1], -inf);
  EXPECT_TRUE(std::isnan(read[2]));
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, RoundTripTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16,
                                           DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// Hand-made files: the reader interprets little-endian bit patterns exactly.
TEST(SafetensorsTest, ReadsLittleEndianBitPatterns) {
  const std::string header =
      R"({"bf16":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
      R"("f16":{"dtype":"F16","shape":[3],"data_offsets":[4,10]},)"
      R"("f32":{"dtype":"F32","shape":[1],"data_offsets":[10,14]}})";
  std::string data;
  data += std::string("\x80\x3f\x00\xc0", 4);          // bf16 1.0, -2.0
  data += std::string("\x01\x00\x00\x3c\xff\x7b", 6);  // f16 2^-24, 1, 65504
  data += std::string("\x00\x00\x80\x3f", 4);          // f32 1.0
  auto file = SafetensorsFile::Open(
      WriteBytes(SerializeSafetensors(header, data), "bits"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(ReadOrDie(**file, "bf16"), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(ReadOrDie(**file, "f16"),
            (std::vector<float>{std::ldexp(1.0f, -24), 1.0f, 65504.0f}));
  EXPECT_EQ(ReadOrDie(**file, "f32"), std::vector<float>{1.0f});
  // The unaligned f32 view points at the right bytes.
  const TensorInfo* f32 = (*file)->Find("f32");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f32->bytes.data()), 4),
            std::string("\x00\x00\x80\x3f", 4));
}

TEST(SafetensorsTest, WriterEncodesBitPatternsAndAlignsTensors) {
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("half", DType::kFloat16, {1}, {1.0f}).ok());
  ASSERT_TRUE(writer.Add("brain", DType::kBFloat16, {1}, {1.0f}).ok());
  ASSERT_TRUE(writer.Add("single", DType::kFloat32, {1}, {1.0f}).ok());
  const std::string bytes = writer.Serialize();
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ((8 + header_length) % 8, 0u) << "header padded to 8 bytes";
  auto file = SafetensorsFile::Open(WriteBytes(bytes, "enc"));
  ASSERT_TRUE(file.ok()) << file.status();
  const auto raw = [&](const std::string& name) {
    const TensorInfo* info = (*file)->Find(name);
    return std::string(reinterpret_cast<const char*>(info->bytes.data()),
                       info->bytes.size());
  };
  EXPECT_EQ(raw("half"), std::string("\x00\x3c", 2));
  EXPECT_EQ(raw("brain"), std::string("\x80\x3f", 2));
  EXPECT_EQ(raw("single"), std::string("\x00\x00\x80\x3f", 4));
  // The 4-byte tensor comes first, so it is 4-byte aligned in the file.
  const TensorInfo* single = (*file)->Find("single");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(single->bytes.data()) % 4, 0u);
}

TEST(SafetensorsTest, MissingFileAndTensorAreNotFound) {
  auto missing = SafetensorsFile::Open("/nonexistent/dir/x.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);

  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a", DType::kFloat32, {1}, {1.0f}).ok());
  auto file = SafetensorsFile::Open(WriteBytes(writer.Serialize(), "nf"));
  ASSERT_TRUE(file.ok());
  std::vector<float> out;
  const absl::Status status = (*file)->ReadAsFloat32("b", &out);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("\"b\""));
  EXPECT_EQ((*file)->Find("b"), nullptr);
}

TEST(SafetensorsTest, WriterRejectsBadTensors) {
  SafetensorsWriter writer;
  EXPECT_FALSE(writer.Add("a", DType::kFloat32, {2, 2}, {1, 2, 3}).ok());
  EXPECT_FALSE(writer.Add("a", DType::kFloat32, {-1}, {}).ok());
  EXPECT_FALSE(writer.Add("__metadata__", DType::kFloat32, {1}, {1}).ok());
  ASSERT_TRUE(writer.Add("a", DType::kFloat32, {1}, {1}).ok());
  EXPECT_FALSE(writer.Add("a", DType::kFloat32, {1}, {1}).ok());
}

// --- malformed files --------------------------------------------------------

struct MalformedCase {
  const char* name;
  std::string bytes;
  const char* message;  // expected substring of the error
};

std::string Tensor(const std::string& name, const std::string& dtype,
                   const std::string& shape, const std::string& offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype,
                      "\",\"shape\":", shape, ",\"data_offsets\":", offsets,
                      "}");
}

std::string File(const std::string& entries, size_t data_bytes) {
  return SerializeSafetensors(absl::StrCat("{", entries, "}"),
                              std::string(data_bytes, '\x11'));
}

std::vector<MalformedCase> MalformedCases() {
  const std::string ok_a = Tensor("a", "F32", "[2]", "[0,8]");
  std::vector<MalformedCase> cases = {
      {"empty_file", "", "shorter than the 8-byte header length"},
      {"seven_bytes", std::string(7, '\0'), "shorter than the 8-byte"},
      {"header_length_past_eof", Uint64Le(100) + "{}", "runs past the end"},
      {"header_length_one_past_eof", Uint64Le(3) + "{}", "runs past the end"},
      {"header_length_huge", Uint64Le(~0ull) + "{}", "exceeds the limit"},
      {"header_length_2_63", Uint64Le(1ull << 63) + "{}", "exceeds the limit"},
      {"header_length_zero", Uint64Le(0), "not valid JSON"},
      {"bad_json", SerializeSafetensors("{\"a\": ", ""), "not valid JSON"},
      {"trailing_garbage_json", SerializeSafetensors("{} x", ""),
       "not valid JSON"},
      {"invalid_utf8", SerializeSafetensors("{\"\xff\xfe\":1}", ""),
       "not valid JSON"},
      {"header_not_object", SerializeSafetensors("[1,2]", ""),
       "must be a JSON object"},
      {"entry_not_object", SerializeSafetensors("{\"a\":[1]}", ""),
       "entry must be an object"},
      {"missing_dtype",
       SerializeSafetensors(R"({"a":{"shape":[1],"data_offsets":[0,4]}})",
                            std::string(4, '\0')),
       "dtype missing"},
      {"dtype_not_string",
       SerializeSafetensors(
           R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})",
           std::string(4, '\0')),
       "dtype missing or not a string"},
      {"unknown_dtype_i32", File(Tensor("a", "I32", "[1]", "[0,4]"), 4),
       "unsupported safetensors dtype \"I32\""},
      {"unknown_dtype_f64", File(Tensor("a", "F64", "[1]", "[0,8]"), 8),
       "\"F64\""},
      {"missing_shape",
       SerializeSafetensors(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})",
                            std::string(4, '\0')),
       "shape missing"},
      {"negative_dim", File(Tensor("a", "F32", "[-1]", "[0,4]"), 4),
       "non-negative integers"},
      {"fractional_dim", File(Tensor("a", "F32", "[1.5]", "[0,4]"), 4),
       "non-negative integers"},
      {"string_dim", File(Tensor("a", "F32", "[\"2\"]", "[0,8]"), 8),
       "non-negative integers"},
      {"numel_overflow",
       File(Tensor("a", "F32", "[4611686018427387904,4611686018427387904]",
                   "[0,4]"),
            4),
       "too large"},
      {"missing_offsets",
       SerializeSafetensors(R"({"a":{"dtype":"F32","shape":[1]}})",
                            std::string(4, '\0')),
       "data_offsets must be"},
      {"three_offsets", File(Tensor("a", "F32", "[1]", "[0,4,8]"), 8),
       "data_offsets must be"},
      {"negative_offset", File(Tensor("a", "F32", "[1]", "[-4,0]"), 4),
       "data_offsets must be"},
      {"offsets_reversed", File(Tensor("a", "F32", "[1]", "[8,4]"), 8),
       "outside the data section"},
      {"offsets_past_data", File(Tensor("a", "F32", "[2]", "[0,8]"), 4),
       "outside the data section"},
      {"offsets_huge",
       File(Tensor("a", "F32", "[1]",
                   "[18446744073709551612,"
                   "18446744073709551615]"),
            4),
       "outside the data section"},
      {"wrong_byte_count", File(Tensor("a", "F32", "[2]", "[0,4]"), 4),
       "needs 8"},
      {"wrong_byte_count_bf16", File(Tensor("a", "BF16", "[2]", "[0,8]"), 8),
       "needs 4"},
      {"overlapping",
       File(ok_a + "," + Tensor("b", "F32", "[2]", "[4,12]"), 12), "overlap"},
      {"identical_ranges",
       File(ok_a + "," + Tensor("b", "F32", "[2]", "[0,8]"), 8), "overlap"},
      {"hole_between",
       File(ok_a + "," + Tensor("b", "F32", "[1]", "[12,16]"), 16),
       "belong to no tensor"},
      {"hole_at_start", File(Tensor("a", "F32", "[1]", "[4,8]"), 8),
       "belong to no tensor"},
      {"trailing_data", File(ok_a, 12), "belong to no tensor"},
      {"duplicate_names",
       File(ok_a + "," + Tensor("a", "F32", "[2]", "[8,16]"), 16),
       "\"a\" appears more than once"},
      {"metadata_not_object", SerializeSafetensors(R"({"__metadata__":1})", ""),
       "__metadata__ must be an object"},
      {"metadata_value_not_string",
       SerializeSafetensors(R"({"__metadata__":{"k":1}})", ""),
       "__metadata__.k must be a string"},
  };
  // A valid two-tensor file truncated at several points.
  SafetensorsWriter writer;
  EXPECT_TRUE(
      writer.Add("x", DType::kFloat32, {4, 4}, std::vector<float>(16)).ok());
  EXPECT_TRUE(
      writer.Add("y", DType::kBFloat16, {8}, std::vector<float>(8)).ok());
  const std::string valid = writer.Serialize();
  uint64_t header_length = 0;
  std::memcpy(&header_length, valid.data(), 8);
  const size_t data_start = 8 + header_length;
  const std::pair<const char*, size_t> cuts[] = {
      {"truncated_at_4", 4},
      {"truncated_at_8", 8},
      {"truncated_mid_header", 8 + header_length / 2},
      {"truncated_at_data_start", data_start},
      {"truncated_mid_data", data_start + 30},
      {"truncated_last_byte", valid.size() - 1},
  };
  for (const auto& [name, size] : cuts) {
    cases.push_back({name, valid.substr(0, size), ""});
  }
  return cases;
}

TEST(SafetensorsTest, MalformedFilesAreErrorsNotCrashes) {
  for (const MalformedCase& c : MalformedCases()) {
    SCOPED_TRACE(c.name);
    auto file = SafetensorsFile::Open(WriteBytes(c.bytes, c.name));
    ASSERT_FALSE(file.ok()) << c.name << " was accepted";
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
        << file.status();
    EXPECT_THAT(std::string(file.status().message()), HasSubstr(c.message));
    // The message names the file.
    EXPECT_THAT(std::string(file.status().message()), HasSubstr(c.name));
  }
}

TEST(SafetensorsTest, AcceptsUnpaddedHeaderAndZeroSizeTensors) {
  const std::string header =
      R"({"z":{"dtype":"F16","shape":[0],"data_offsets":[0,0]},)"
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  auto file = SafetensorsFile::Open(
      WriteBytes(SerializeSafetensors(header, std::string(4, '\0')), "z"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 2u);
}

// Every single-byte corruption of a small valid file is either rejected or
// yields tensors that read back within the mapping; ASan checks the latter.
TEST(SafetensorsTest, SingleByteCorruptionsNeverReadOutOfBounds) {
  SafetensorsWriter writer;
  ASSERT_TRUE(
      writer.Add("w", DType::kBFloat16, {2, 3}, {1, 2, 3, 4, 5, 6}).ok());
  ASSERT_TRUE(writer.Add("b", DType::kFloat32, {3}, {1, 2, 3}).ok());
  const std::string valid = writer.Serialize();
  const std::string dir = model_testing::MakeUniqueTempDir("corrupt");
  int accepted = 0;
  for (size_t position = 0; position < valid.size(); ++position) {
    for (const uint8_t replacement :
         {uint8_t{0x00}, uint8_t{0x7f}, uint8_t{'9'}, uint8_t{0xff}}) {
      std::string bytes = valid;
      bytes[position] = static_cast<char>(replacement);
      const std::string path = absl::StrCat(dir, "/f");
      {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      }
      auto file = SafetensorsFile::Open(path);
      if (!file.ok()) continue;
      ++accepted;
      for (const auto& [name, info] : (*file)->tensors()) {
        std::vector<float> values;
        ASSERT_TRUE((*file)->ReadAsFloat32(name, &values).ok());
        ASSERT_EQ(values.size(), static_cast<size_t>(info.NumElements()));
      }
    }
  }
  // Corrupting tensor data (not the header) keeps the file valid.
  EXPECT_GT(accepted, 0);
}

}  // namespace
}  // namespace pdworker
