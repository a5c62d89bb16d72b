#include "worker/model/float16.h"

#include <cstring>

namespace pdworker {
namespace {

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

constexpr uint32_t kF32ExponentMask = 0x7f800000u;
constexpr uint32_t kF32MantissaMask = 0x007fffffu;

bool IsNan(uint32_t f32_bits) {
  return (f32_bits & kF32ExponentMask) == kF32ExponentMask &&
         (f32_bits & kF32MantissaMask) != 0;
}

}  // namespace

float BFloat16BitsToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t bits = FloatBits(value);
  if (IsNan(bits)) {
    // Truncating could clear every mantissa bit and turn NaN into inf; set
    // the quiet bit instead.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even;
  // a carry out of the mantissa correctly bumps the exponent (up to inf).
  const uint32_t lowest_kept_bit = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lowest_kept_bit) >> 16);
}

float Float16BitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {
    // Inf (mantissa 0) or NaN (payload kept in the top mantissa bits).
    return BitsToFloat(sign | kF32ExponentMask | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return BitsToFloat(sign);  // +-0
    // Subnormal: value = mantissa * 2^-24. Normalize so the leading one
    // becomes the implicit bit of a float32; every float16 subnormal is a
    // float32 normal.
    int32_t f32_exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --f32_exponent;
    }
    mantissa &= 0x3ffu;
    return BitsToFloat(sign | (static_cast<uint32_t>(f32_exponent) << 23) |
                       (mantissa << 13));
  }
  return BitsToFloat(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

uint16_t FloatToFloat16Bits(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t f32_exponent = (bits >> 23) & 0xffu;
  uint32_t mantissa = bits & kF32MantissaMask;

  if (f32_exponent == 0xff) {
    if (mantissa == 0) return sign | 0x7c00u;  // +-inf
    // Keep the top payload bits and force the quiet bit so it stays NaN.
    return static_cast<uint16_t>(sign | 0x7c00u | 0x0200u | (mantissa >> 13));
  }

  // Exponent re-biased for float16; <= 0 means subnormal (or zero) there.
  const int32_t exponent = static_cast<int32_t>(f32_exponent) - 127 + 15;
  if (exponent >= 0x1f) return sign | 0x7c00u;  // overflow -> inf

  if (exponent <= 0) {
    // Below 2^-25 everything rounds to zero (2^-25 itself is a tie that
    // goes to the even value, zero). float32 subnormals land here too.
    if (exponent < -10) return sign;
    // Make the implicit bit explicit and shift into the 10-bit subnormal
    // mantissa: 24 significant bits -> (10 + exponent) bits.
    mantissa |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - exponent);  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (half & 1u) != 0)) {
      ++half;  // may carry into the exponent: 0x400 is the smallest normal
    }
    return static_cast<uint16_t>(sign | half);
  }

  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t remainder = mantissa & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u) != 0)) {
    ++half;  // a carry into exponent 0x1f yields exactly inf (0x7c00)
  }
  return static_cast<uint16_t>(sign | half);
}

}  // namespace pdworker
