// float16 / bfloat16 / float8 e4m3 <-> float32 conversions for host code (the reference, the CPU
// backend, the server and client). Bit manipulation only, so results are the same on every x86-64
// and need no F16C: float -> 16-bit rounds to nearest even, NaN stays NaN, overflow becomes inf,
// subnormals are kept. float8 e4m3 (kernels/float8.h, shared with device code) has no inf: what
// rounds past 448 becomes NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/attention_params.h"
#include "kernels/float8.h"

namespace attention {

inline float HalfToFloat(uint16_t h) {
  // Shift exponent and mantissa into float position and rebias; fix up inf/NaN and subnormals.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exponent = bits & (0x7c00u << 13);
  bits += (127 - 15) << 23;
  if (exponent == (0x7c00u << 13)) {
    bits += (128 - 16) << 23;  // inf / NaN: exponent all ones
  } else if (exponent == 0) {
    // Subnormal (or zero): value = mantissa * 2^-24, done exactly in float.
    bits += 1 << 23;
    bits = std::bit_cast<uint32_t>(std::bit_cast<float>(bits) - std::bit_cast<float>(113u << 23));
  }
  return std::bit_cast<float>(bits | sign);
}

inline uint16_t FloatToHalf(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint16_t out;
  if (bits >= (143u << 23)) {  // >= 65536 before rounding, inf or NaN
    out = bits > (255u << 23) ? 0x7e00 : 0x7c00;
  } else if (bits < (113u << 23)) {
    // Result is subnormal or zero: let float addition do the round-to-nearest-even shift.
    constexpr float kDenormMagic = std::bit_cast<float>(((127u - 15u) + (23u - 10u) + 1u) << 23);
    const float sum = std::bit_cast<float>(bits) + kDenormMagic;
    out =
        static_cast<uint16_t>(std::bit_cast<uint32_t>(sum) - std::bit_cast<uint32_t>(kDenormMagic));
  } else {
    const uint32_t mantissa_odd = (bits >> 13) & 1u;
    bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;  // rebias and round half up...
    bits += mantissa_odd;                                      // ...to even
    out = static_cast<uint16_t>(bits >> 13);                   // may carry into inf: correct
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float BFloat16ToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // nearest, ties to even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Element `i` of an array of `dtype` as float.
inline float LoadAsFloat(const void* base, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat8E4M3:
      return Float8E4m3ToFloat(static_cast<const uint8_t*>(base)[i]);
  }
  return 0.0f;
}

// Stores `x` as element `i` of an array of `dtype` (rounding to nearest even).
inline void StoreFromFloat(void* base, int64_t i, DType dtype, float x) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = x;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[i] = FloatToHalf(x);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = FloatToBFloat16(x);
      return;
    case DType::kFloat8E4M3:
      static_cast<uint8_t*>(base)[i] = FloatToFloat8E4m3(x);
      return;
  }
}

// dst[0, n) = float(src[0, n)) * scale. The dtype switch sits outside the loop.
inline void ConvertRow(DType dtype, const void* src, int64_t n, float scale, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* s = static_cast<const unsigned char*>(src);
      for (int64_t x = 0; x < n; ++x) {
        float f;
        std::memcpy(&f, s + x * sizeof(float), sizeof(float));
        dst[x] = f * scale;
      }
      return;
    }
    case DType::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t x = 0; x < n; ++x) dst[x] = HalfToFloat(s[x]) * scale;
      return;
    }
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t x = 0; x < n; ++x) dst[x] = BFloat16ToFloat(s[x]) * scale;
      return;
    }
    case DType::kFloat8E4M3: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (int64_t x = 0; x < n; ++x) dst[x] = Float8E4m3ToFloat(s[x]) * scale;
      return;
    }
  }
}

// dst[0, n) = src[0, n) * scale in `dtype` (rounding to nearest even). The switch sits outside
// the loop.
inline void StoreRow(const float* src, int64_t n, float scale, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      auto* d = static_cast<unsigned char*>(dst);
      for (int64_t x = 0; x < n; ++x) {
        const float f = src[x] * scale;
        std::memcpy(d + x * sizeof(float), &f, sizeof(float));
      }
      return;
    }
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t x = 0; x < n; ++x) d[x] = FloatToHalf(src[x] * scale);
      return;
    }
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t x = 0; x < n; ++x) d[x] = FloatToBFloat16(src[x] * scale);
      return;
    }
    case DType::kFloat8E4M3: {
      auto* d = static_cast<uint8_t*>(dst);
      for (int64_t x = 0; x < n; ++x) d[x] = FloatToFloat8E4m3(src[x] * scale);
      return;
    }
  }
}

}  // namespace attention
