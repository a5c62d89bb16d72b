// Conversions between float32 and the two 16-bit float formats found in
// checkpoints, on raw bit patterns (little-endian storage is the caller's
// business). Written here rather than taken from a library so the CPU build
// needs no CUDA headers; exact for every representable value.
//
//   bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits -- the upper half
//             of a float32.
//   float16:  1 sign, 5 exponent (bias 15), 10 mantissa bits; subnormals down
//             to 2^-24, max finite 65504.
#ifndef PDWORKER_WORKER_MODEL_FLOAT16_H_
#define PDWORKER_WORKER_MODEL_FLOAT16_H_

#include <cstdint>

namespace pdworker {

// Exact (every bfloat16 is a float32). NaN payloads are kept.
float BFloat16BitsToFloat(uint16_t bits);

// Round to nearest, ties to even; overflow rounds to +-inf; NaN stays a
// (quiet) NaN with its sign.
uint16_t FloatToBFloat16Bits(float value);

// Exact, subnormals included (0x0001 == 2^-24). Inf stays inf, NaN stays NaN.
float Float16BitsToFloat(uint16_t bits);

// Round to nearest, ties to even, producing float16 subnormals below 2^-14
// and +-0 below 2^-25; values that round above 65504 become +-inf; NaN stays a
// (quiet) NaN with its sign.
uint16_t FloatToFloat16Bits(float value);

}  // namespace pdworker

#endif  // PDWORKER_WORKER_MODEL_FLOAT16_H_
