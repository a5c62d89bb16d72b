// UploadTensor on the threaded CPU stream (copies run after the host queued
// them, as DMAs do): every source dtype into both device dtypes, through a
// ring far smaller than the tensor, so chunks reuse blocks whose earlier
// copies the host had to wait for; the last chunk is partial.
#include "worker/model/weight_upload.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/float16.h"
#include "worker/model/safetensors.h"
#include "worker/runtime/arena.h"
#include "worker/runtime/cpu_device.h"
#include "worker/runtime/upload_ring.h"

namespace pdworker {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kCount = 1001;  // 7 x 143: no multiple of a chunk

// kCount values of `dtype` as little-endian bytes, spanning signs and scales
// (f16 ones within its range).
std::vector<uint8_t> RandomBytes(DType dtype) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<uint8_t> bytes(kCount * DTypeSize(dtype));
  for (int64_t i = 0; i < kCount; ++i) {
    const float value = std::ldexp(mantissa(rng), exponent(rng));
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &value, 4);
    } else {
      const uint16_t bits = dtype == DType::kBFloat16
                                ? FloatToBFloat16Bits(value)
                                : FloatToFloat16Bits(value);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  return bytes;
}

struct Case {
  DType src;
  DType dst;
};

class WeightUploadTest : public ::testing::TestWithParam<Case> {
 protected:
  WeightUploadTest() : device_(Options()) {}
  static CpuDeviceOptions Options() {
    CpuDeviceOptions options;
    options.stream_execution = CpuStreamExecution::kThreaded;
    return options;
  }
  CpuDevice device_;
};

TEST_P(WeightUploadTest, ConvertsEveryElementThroughASmallRing) {
  const Case c = GetParam();
  const std::vector<uint8_t> source = RandomBytes(c.src);
  TensorInfo tensor{c.src, {7, 143}, absl::MakeConstSpan(source)};
  ASSERT_EQ(tensor.NumElements(), kCount);

  // What each element must become: float32 through ConvertToFloat32, then
  // bf16 rounded to nearest even (bf16 sources round-trip exactly).
  std::vector<float> widened(kCount);
  ConvertToFloat32(c.src, source.data(), kCount, widened.data());
  std::vector<uint8_t> expected(kCount * DTypeSize(c.dst));
  for (int64_t i = 0; i < kCount; ++i) {
    if (c.dst == DType::kFloat32) {
      std::memcpy(expected.data() + 4 * i, &widened[i], 4);
    } else {
      const uint16_t bits = FloatToBFloat16Bits(widened[i]);
      std::memcpy(expected.data() + 2 * i, &bits, 2);
    }
  }

  auto stream = device_.CreateStream();
  ASSERT_TRUE(stream.ok());
  // 2 blocks of 96 bytes: 24 fp32 or 48 bf16 elements per chunk, so the
  // tensor takes 21-42 chunks and every block is reused many times.
  auto ring = UploadRing::Create(device_, 96, 2);
  ASSERT_TRUE(ring.ok()) << ring.status();
  auto arena = Arena::Create(device_, {2 * expected.size() + 1024, 256, "w"});
  ASSERT_TRUE(arena.ok());
  // One guard byte past the tensor: nothing may write it.
  auto dst = (*arena)->Allocate(expected.size() + 1, "tensor");
  ASSERT_TRUE(dst.ok());
  std::vector<uint8_t> guard = {0x5A};
  ASSERT_TRUE(
      (*stream)
          ->CopyToDevice(dst->Slice(expected.size(), 1), guard.data(), 1)
          .ok());

  ASSERT_TRUE(UploadTensor(tensor, c.dst, ring->get(), **stream, *dst).ok());
  std::vector<uint8_t> got(expected.size() + 1);
  ASSERT_TRUE((*stream)->CopyToHost(got.data(), *dst, got.size()).ok());
  EXPECT_EQ(got.back(), 0x5A);
  got.pop_back();
  EXPECT_EQ(got, expected);

  // Without a ring (what the CPU backend's load does): the stream converts
  // from the mapping straight into the destination, to the same bytes.
  auto direct = (*arena)->Allocate(expected.size() + 1, "direct");
  ASSERT_TRUE(direct.ok());
  ASSERT_TRUE(
      (*stream)
          ->CopyToDevice(direct->Slice(expected.size(), 1), guard.data(), 1)
          .ok());
  ASSERT_TRUE(UploadTensor(tensor, c.dst, nullptr, **stream, *direct).ok());
  std::vector<uint8_t> direct_got(expected.size() + 1);
  ASSERT_TRUE((*stream)
                  ->CopyToHost(direct_got.data(), *direct, direct_got.size())
                  .ok());
  EXPECT_EQ(direct_got.back(), 0x5A);
  direct_got.pop_back();
  EXPECT_EQ(direct_got, expected);
}

INSTANTIATE_TEST_SUITE_P(
    SourceAndDevice, WeightUploadTest,
    ::testing::Values(Case{DType::kFloat32, DType::kFloat32},
                      Case{DType::kBFloat16, DType::kFloat32},
                      Case{DType::kFloat16, DType::kFloat32},
                      Case{DType::kFloat32, DType::kBFloat16},
                      Case{DType::kBFloat16, DType::kBFloat16},
                      Case{DType::kFloat16, DType::kBFloat16}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(DTypeName(info.param.src)) + "_to_" +
             std::string(DTypeName(info.param.dst));
    });

TEST(WeightUploadErrorsTest, RefusesWithoutWriting) {
  CpuDevice device{CpuDeviceOptions{}};
  auto stream = device.CreateStream();
  ASSERT_TRUE(stream.ok());
  auto ring = UploadRing::Create(device, 64, 2);
  ASSERT_TRUE(ring.ok());
  const std::vector<uint8_t> source(40, 0);
  TensorInfo tensor{DType::kFloat32, {10}, absl::MakeConstSpan(source)};
  auto arena = Arena::Create(device, {1024, 256, "w"});
  ASSERT_TRUE(arena.ok());
  auto small = (*arena)->Allocate(39, "small");
  ASSERT_TRUE(small.ok());

  absl::Status too_small =
      UploadTensor(tensor, DType::kFloat32, ring->get(), **stream, *small);
  EXPECT_EQ(too_small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_small.message(), HasSubstr("39 bytes"));
  absl::Status fp16 =
      UploadTensor(tensor, DType::kFloat16, ring->get(), **stream, *small);
  EXPECT_EQ(fp16.code(), absl::StatusCode::kInvalidArgument);

  auto tiny_ring = UploadRing::Create(device, 2, 2);
  ASSERT_TRUE(tiny_ring.ok());
  auto fits = (*arena)->Allocate(40, "fits");
  ASSERT_TRUE(fits.ok());
  absl::Status no_element =
      UploadTensor(tensor, DType::kFloat32, tiny_ring->get(), **stream, *fits);
  EXPECT_EQ(no_element.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdworker
