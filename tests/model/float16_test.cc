// float16/bfloat16 <-> float32 conversions: specific bit patterns, every
// 16-bit pattern against an independent ldexp formula, and round-to-nearest-
// even at ties.
#include "worker/model/float16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace pdworker {
namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// IEEE binary16 value by definition, computed in double with ldexp.
double Float16ByDefinition(uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

// bfloat16 value by definition (8-bit exponent, bias 127, 7 mantissa bits).
double BFloat16ByDefinition(uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent = (bits >> 7) & 0xff;
  const int mantissa = bits & 0x7f;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -133);
  } else if (exponent == 255) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  } else {
    magnitude = std::ldexp(128 + mantissa, exponent - 134);
  }
  return sign ? -magnitude : magnitude;
}

TEST(BFloat16Test, SpecificPatterns) {
  EXPECT_EQ(BFloat16BitsToFloat(0x3F80), 1.0f);
  EXPECT_EQ(BFloat16BitsToFloat(0xC000), -2.0f);
  EXPECT_EQ(BFloat16BitsToFloat(0x3E80), 0.25f);
  EXPECT_EQ(BFloat16BitsToFloat(0x7F80),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(BFloat16BitsToFloat(0xFF80),
            -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(BFloat16BitsToFloat(0x7FC0)));
  EXPECT_TRUE(std::isnan(BFloat16BitsToFloat(0xFF81)));
  EXPECT_EQ(Bits(BFloat16BitsToFloat(0x8000)), 0x80000000u);  // -0
  // Smallest bfloat16 subnormal: 2^-133.
  EXPECT_EQ(BFloat16BitsToFloat(0x0001), std::ldexp(1.0f, -133));
}

TEST(BFloat16Test, EveryPatternMatchesDefinitionAndRoundTrips) {
  for (uint32_t pattern = 0; pattern <= 0xffff; ++pattern) {
    const uint16_t bits = static_cast<uint16_t>(pattern);
    const float value = BFloat16BitsToFloat(bits);
    const double expected = BFloat16ByDefinition(bits);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(value)) << std::hex << pattern;
      EXPECT_TRUE(std::isnan(BFloat16BitsToFloat(FloatToBFloat16Bits(value))))
          << std::hex << pattern;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), expected) << std::hex << pattern;
    ASSERT_EQ(FloatToBFloat16Bits(value), bits) << std::hex << pattern;
  }
}

TEST(BFloat16Test, RoundsToNearestEven) {
  const float ulp = std::ldexp(1.0f, -7);  // bfloat16 spacing in [1, 2)
  EXPECT_EQ(FloatToBFloat16Bits(1.0f + ulp / 2), 0x3F80);      // tie -> even
  EXPECT_EQ(FloatToBFloat16Bits(1.0f + 3 * ulp / 2), 0x3F82);  // tie -> even
  EXPECT_EQ(FloatToBFloat16Bits(1.0f + ulp / 2 + std::ldexp(1.0f, -20)),
            0x3F81);  // above the tie -> up
  EXPECT_EQ(FloatToBFloat16Bits(1.0f + ulp / 2 - std::ldexp(1.0f, -20)),
            0x3F80);  // below the tie -> down
  EXPECT_EQ(FloatToBFloat16Bits(-1.0f - ulp / 2), 0xBF80);
  // Overflow past the largest finite bfloat16 rounds to infinity.
  EXPECT_EQ(FloatToBFloat16Bits(std::numeric_limits<float>::max()), 0x7F80);
  // A NaN whose payload sits only in the dropped bits stays NaN.
  float nan_low_payload;
  const uint32_t nan_bits = 0x7F800001u;
  std::memcpy(&nan_low_payload, &nan_bits, sizeof(nan_low_payload));
  EXPECT_TRUE(
      std::isnan(BFloat16BitsToFloat(FloatToBFloat16Bits(nan_low_payload))));
}

TEST(Float16Test, SpecificPatterns) {
  EXPECT_EQ(Float16BitsToFloat(0x3C00), 1.0f);
  EXPECT_EQ(Float16BitsToFloat(0xC000), -2.0f);
  EXPECT_EQ(Float16BitsToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Float16BitsToFloat(0x0001), std::ldexp(1.0f, -24));  // subnormal
  EXPECT_EQ(Float16BitsToFloat(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16BitsToFloat(0x0400), std::ldexp(1.0f, -14));  // min normal
  EXPECT_EQ(Float16BitsToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(Float16BitsToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Float16BitsToFloat(0xFC00),
            -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Float16BitsToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(Float16BitsToFloat(0x7C01)));
  EXPECT_EQ(Bits(Float16BitsToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(Float16BitsToFloat(0x8001), -std::ldexp(1.0f, -24));
}

TEST(Float16Test, EveryPatternMatchesDefinitionAndRoundTrips) {
  for (uint32_t pattern = 0; pattern <= 0xffff; ++pattern) {
    const uint16_t bits = static_cast<uint16_t>(pattern);
    const float value = Float16BitsToFloat(bits);
    const double expected = Float16ByDefinition(bits);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(value)) << std::hex << pattern;
      EXPECT_TRUE(std::isnan(Float16BitsToFloat(FloatToFloat16Bits(value))))
          << std::hex << pattern;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), expected) << std::hex << pattern;
    ASSERT_EQ(FloatToFloat16Bits(value), bits) << std::hex << pattern;
  }
}

TEST(Float16Test, RoundsToNearestEven) {
  const float tiny = std::ldexp(1.0f, -24);             // smallest subnormal
  EXPECT_EQ(FloatToFloat16Bits(tiny / 2), 0x0000);      // tie -> even (0)
  EXPECT_EQ(FloatToFloat16Bits(tiny * 0.75f), 0x0001);  // above the tie
  EXPECT_EQ(FloatToFloat16Bits(tiny * 1.5f), 0x0002);   // tie -> even (2)
  EXPECT_EQ(FloatToFloat16Bits(tiny * 2.5f), 0x0002);   // tie -> even (2)
  EXPECT_EQ(FloatToFloat16Bits(tiny / 4), 0x0000);
  EXPECT_EQ(FloatToFloat16Bits(-tiny / 4), 0x8000);  // keeps the sign
  EXPECT_EQ(FloatToFloat16Bits(1e-30f), 0x0000);
  EXPECT_EQ(FloatToFloat16Bits(std::numeric_limits<float>::denorm_min()),
            0x0000);
  // Largest subnormal + half a step rounds up into the smallest normal.
  EXPECT_EQ(FloatToFloat16Bits(1023.5f * tiny), 0x0400);
  const float ulp = std::ldexp(1.0f, -10);  // spacing in [1, 2)
  EXPECT_EQ(FloatToFloat16Bits(1.0f + ulp / 2), 0x3C00);
  EXPECT_EQ(FloatToFloat16Bits(1.0f + 3 * ulp / 2), 0x3C02);
  EXPECT_EQ(FloatToFloat16Bits(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToFloat16Bits(65519.0f), 0x7BFF);  // below the tie
  EXPECT_EQ(FloatToFloat16Bits(65520.0f), 0x7C00);  // tie, odd -> inf
  EXPECT_EQ(FloatToFloat16Bits(1e9f), 0x7C00);
  EXPECT_EQ(FloatToFloat16Bits(-1e9f), 0xFC00);
  EXPECT_TRUE(std::isnan(Float16BitsToFloat(
      FloatToFloat16Bits(std::numeric_limits<float>::quiet_NaN()))));
}

// For a sweep of float32 inputs (every binade from 2^-26 to 2^16, both
// signs) the encoding is a nearest float16: neither neighbour of the chosen
// pattern is strictly closer.
TEST(Float16Test, EncodingPicksANearestValue) {
  for (int exponent = -26; exponent <= 16; ++exponent) {
    for (int step = 0; step < 1000; ++step) {
      for (const float sign : {1.0f, -1.0f}) {
        const float x = sign * std::ldexp(1.0f + step / 1000.0f, exponent);
        const uint16_t bits = FloatToFloat16Bits(x);
        const double chosen = Float16ByDefinition(bits);
        if (std::isinf(chosen)) {
          EXPECT_GE(std::fabs(x), 65520.0f) << x;
          continue;
        }
        const double error = std::fabs(chosen - x);
        for (const int delta : {-1, 1}) {
          const uint16_t neighbour = static_cast<uint16_t>(bits + delta);
          // Only finite neighbours of the same sign.
          if ((neighbour & 0x7fff) >= 0x7c00 ||
              (neighbour & 0x8000) != (bits & 0x8000)) {
            continue;
          }
          ASSERT_LE(error, std::fabs(Float16ByDefinition(neighbour) - x)) << x;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pdworker
