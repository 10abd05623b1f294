// float8 e4m3 <-> float32, one copy for host code (dtype_convert.h, the reference, the CPU backend,
// clients) and CUDA device code (the dequantising kernel, kernels/cuda/prep/dequantise.cu): plain
// C++17 with no library call that device code lacks.
//
// The format is OCP FP8 E4M3FN: 1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits. No
// infinities; S.1111.111 is NaN (0x7f, 0xff), so the largest finite value is S.1111.110 = 448;
// exponent 0 holds subnormals m * 2^-9. Every e4m3 value (4 significant bits, magnitudes 2^-9 ..
// 448) is exact in float32, float16 and bfloat16, which is why the backends can dequantise
// without rounding.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace attention {

ATTENTION_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

ATTENTION_HOST_DEVICE inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// The value of e4m3 byte `x`, exactly.
ATTENTION_HOST_DEVICE inline float Float8E4m3ToFloat(uint8_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t magnitude = x & 0x7fu;                            // exponent << 3 | mantissa
  if (magnitude == 0x7fu) return BitsToFloat(sign | 0x7fc00000u);  // NaN
  if (magnitude < 0x08u) {
    // Subnormal (or zero): mantissa * 2^-9, exact in float.
    const float value = static_cast<float>(magnitude) * (1.0f / 512.0f);
    return sign != 0 ? -value : value;
  }
  // Normal: the exponent and mantissa move into float position, the bias from 7 to 127.
  return BitsToFloat(sign | ((magnitude << 20) + (120u << 23)));
}

// `f` rounded to the nearest e4m3 value, ties to even. NaN, infinities and magnitudes that round
// beyond 448 (above 464) become NaN, as the format has no infinity (OCP's non-saturating
// conversion; torch's float8_e4m3fn does the same).
ATTENTION_HOST_DEVICE inline uint8_t FloatToFloat8E4m3(float f) {
  uint32_t bits = FloatToBits(f);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits >= 0x43f00000u) return sign | 0x7fu;  // >= 480 (rounds past 448), inf, NaN
  if (bits < 0x3c800000u) {
    // Below 2^-6, the smallest normal: subnormal steps of 2^-9. |f| * 2^9 < 8 is exact in float,
    // so rounding it to an integer (ties to even) rounds f.
    const float scaled = BitsToFloat(bits) * 512.0f;
    auto m = static_cast<uint32_t>(scaled);  // truncated
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u) != 0)) ++m;  // m == 8 is the smallest normal
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: drop 20 mantissa bits, rounding to nearest even; a carry moves into the exponent
  // (and 464 < f < 480 carries into 0x7f, NaN, as it should).
  bits += 0x7ffffu + ((bits >> 20) & 1u);
  return static_cast<uint8_t>(sign | ((bits >> 20) - (120u << 3)));
}

}  // namespace attention
