// The float16/bfloat16 conversions against the compiler's _Float16 and a direct rounding rule.
#include "kernels/dtype_convert.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

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

}  // namespace
}  // namespace attention
