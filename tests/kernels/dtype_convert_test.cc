// The float16/bfloat16 conversions against the compiler's _Float16 and a direct rounding rule;
// float8 e4m3 against its definition (OCP E4M3FN) on every byte and a nearest-value search.
#include "kernels/dtype_convert.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attention {
namespace {

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) ||
         std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

TEST(DTypeConvertTest, HalfToFloatMatchesCompilerOnEveryPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float expected = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(h)));
    ASSERT_TRUE(SameFloat(HalfToFloat(static_cast<uint16_t>(h)), expected))
        << "half 0x" << std::hex << h;
  }
}

TEST(DTypeConvertTest, FloatToHalfMatchesCompiler) {
  std::random_device device;
  const uint32_t seed = device();
  std::mt19937 rng(seed);
  // Random bit patterns cover every exponent; the specials and ties are added by hand.
  std::vector<float> values = {0.0f,      -0.0f,         65504.0f,       65520.0f,      65519.99f,
                               1e-8f,     2.9802322e-8f, 5.9604645e-8f,  6.1035156e-5f, INFINITY,
                               -INFINITY, NAN,           1.00048828125f, 1.00146484375f};
  for (int i = 0; i < 2'000'000; ++i)
    values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (float f : values) {
    const uint16_t expected = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    const uint16_t got = FloatToHalf(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(HalfToFloat(got))) << "seed " << seed;
    } else {
      ASSERT_EQ(got, expected) << "float " << f << " bits 0x" << std::hex
                               << std::bit_cast<uint32_t>(f) << " seed " << std::dec << seed;
    }
  }
}

TEST(DTypeConvertTest, FloatToBFloat16RoundsToNearestEven) {
  std::random_device device;
  const uint32_t seed = device();
  std::mt19937 rng(seed);
  for (int i = 0; i < 2'000'000; ++i) {
    const uint32_t bits = rng();
    const float f = std::bit_cast<float>(bits);
    const uint16_t got = FloatToBFloat16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(BFloat16ToFloat(got)));
      continue;
    }
    // The two candidates bracketing f; the nearer wins, a tie goes to the even one.
    const uint16_t down = static_cast<uint16_t>(bits >> 16);
    const uint32_t low = bits & 0xffffu;
    const uint16_t expected =
        low > 0x8000u || (low == 0x8000u && (down & 1u)) ? static_cast<uint16_t>(down + 1) : down;
    ASSERT_EQ(got, expected) << "bits 0x" << std::hex << bits << " seed " << std::dec << seed;
    ASSERT_TRUE(
        SameFloat(BFloat16ToFloat(got), std::bit_cast<float>(static_cast<uint32_t>(got) << 16)));
  }
}

// The e4m3 value of byte x from the format's definition (OCP FP8 E4M3FN), in double.
double E4m3ByDefinition(uint8_t x) {
  const int exponent = (x >> 3) & 0xf, mantissa = x & 7;
  const double sign = (x & 0x80) ? -1.0 : 1.0;
  if (exponent == 0xf && mantissa == 7) return NAN;
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, -6);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

TEST(DTypeConvertTest, Float8E4m3ToFloatMatchesDefinitionOnEveryByte) {
  for (uint32_t x = 0; x < 256; ++x) {
    const double expected = E4m3ByDefinition(static_cast<uint8_t>(x));
    const float got = Float8E4m3ToFloat(static_cast<uint8_t>(x));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << "e4m3 0x" << std::hex << x;
    } else {
      ASSERT_EQ(static_cast<double>(got), expected) << "e4m3 0x" << std::hex << x;
      ASSERT_EQ(std::signbit(got), (x & 0x80) != 0) << "e4m3 0x" << std::hex << x;  // -0 too
    }
  }
  EXPECT_EQ(Float8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Float8E4m3ToFloat(0x01), 1.0f / 512);
  EXPECT_EQ(Float8E4m3ToFloat(0x08), 1.0f / 64);
}

TEST(DTypeConvertTest, FloatToFloat8E4m3RoundsToNearestEven) {
  // The finite values, ascending, and their bytes (positive half; the sign is one bit).
  std::vector<std::pair<double, uint8_t>> finite;
  for (uint32_t x = 0; x < 0x7f; ++x) finite.push_back({E4m3ByDefinition(x), x});
  std::random_device device;
  const uint32_t seed = device();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> log2(-14.0f, 9.5f);
  std::vector<float> values = {0.0f,        448.0f,      463.99f,     464.0f,
                               464.01f,     479.0f,      480.0f,      1e6f,
                               1.0f / 1024, 1.0f / 1023, 3.0f / 1024, 1.0f / 64 - 1.0f / 1024,
                               1.0625f,     1.1875f,     17.0f,       1e-30f};
  for (int i = 0; i < 200'000; ++i) values.push_back(std::exp2(log2(rng)));
  for (const auto& [value, byte] : finite) {  // every value and every midpoint
    values.push_back(static_cast<float>(value));
    if (byte + 1 < 0x7f) {
      values.push_back(static_cast<float>((value + finite[byte + 1].first) / 2));
    }
  }
  for (float f : values) {
    // The nearest finite value; a tie goes to the even byte; past 464 (448's upper midpoint)
    // there is no nearer finite value than "beyond 448": NaN.
    uint8_t expected = 0x7f;
    if (f <= 464.0f) {
      size_t best = 0;
      for (size_t i = 1; i < finite.size(); ++i) {
        const double di = std::fabs(finite[i].first - f), db = std::fabs(finite[best].first - f);
        if (di < db || (di == db && (finite[i].second & 1) == 0)) best = i;
      }
      expected = finite[best].second;
    }
    ASSERT_EQ(FloatToFloat8E4m3(f), expected) << "float " << f << " seed " << seed;
    ASSERT_EQ(FloatToFloat8E4m3(-f), expected | 0x80) << "float " << -f << " seed " << seed;
  }
  for (float special : {INFINITY, -INFINITY, NAN}) {
    EXPECT_TRUE(std::isnan(Float8E4m3ToFloat(FloatToFloat8E4m3(special)))) << special;
  }
}

}  // namespace
}  // namespace attention
