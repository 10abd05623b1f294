// HoldsNonFinite against std::isfinite on every float16, bfloat16 and float8 e4m3 pattern and on
// float32 specials, at every position of short tensors (the word-at-a-time body and the tail).
#include "kernels/non_finite.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype_convert.h"

namespace attention {
namespace {

TEST(NonFiniteTest, EverySixteenBitPattern) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const auto bits = static_cast<uint16_t>(h);
      const float f =
          dtype == DType::kFloat16 ? HalfToFloat(bits) : std::bit_cast<float>(uint32_t{bits} << 16);
      const bool expected = !std::isfinite(f);
      // One element alone (tail only) and at position 5 of 7 (a word, then the tail), 13 of 16.
      std::vector<uint16_t> x(16, 0x3c00);
      x[13] = bits;
      ASSERT_EQ(HoldsNonFinite(dtype, &bits, 1), expected) << std::hex << h;
      ASSERT_EQ(HoldsNonFinite(dtype, x.data(), 16), expected) << std::hex << h;
      x[13] = 0x3c00;
      x[5] = bits;
      ASSERT_EQ(HoldsNonFinite(dtype, x.data(), 7), expected) << std::hex << h;
      ASSERT_FALSE(HoldsNonFinite(dtype, x.data(), 5));
    }
  }
}

TEST(NonFiniteTest, Float32AtEveryPosition) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (float bad :
       {kInf, -kInf, std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0xff800001u)}) {
    for (int n : {1, 2, 3, 1025, 3000}) {
      for (int at = 0; at < n; at += at < 8 ? 1 : 97) {
        std::vector<float> x(n, 1.5f);
        x[at] = bad;
        ASSERT_TRUE(HoldsNonFinite(DType::kFloat32, x.data(), n)) << n << " " << at;
        ASSERT_FALSE(HoldsNonFinite(DType::kFloat32, x.data(), at)) << n << " " << at;
      }
    }
  }
  const std::vector<float> finite = {std::numeric_limits<float>::max(),
                                     -std::numeric_limits<float>::max(),
                                     std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f};
  EXPECT_FALSE(HoldsNonFinite(DType::kFloat32, finite.data(), finite.size()));
  EXPECT_FALSE(HoldsNonFinite(DType::kFloat32, nullptr, 0));
}

TEST(NonFiniteTest, EveryFloat8Pattern) {
  for (uint32_t b = 0; b < 256; ++b) {
    const auto bits = static_cast<uint8_t>(b);
    const bool expected = !std::isfinite(Float8E4m3ToFloat(bits));  // 0x7f and 0xff only
    // Alone (tail only), at 13 of 16 (the second word) and at 5 of 7 (the tail after none).
    std::vector<uint8_t> x(16, 0x7e);  // 448, the largest finite value
    x[13] = bits;
    ASSERT_EQ(HoldsNonFinite(DType::kFloat8E4M3, &bits, 1), expected) << std::hex << b;
    ASSERT_EQ(HoldsNonFinite(DType::kFloat8E4M3, x.data(), 16), expected) << std::hex << b;
    x[13] = 0x7e;
    x[5] = bits;
    ASSERT_EQ(HoldsNonFinite(DType::kFloat8E4M3, x.data(), 7), expected) << std::hex << b;
    ASSERT_FALSE(HoldsNonFinite(DType::kFloat8E4M3, x.data(), 5));
  }
}

}  // namespace
}  // namespace attention
