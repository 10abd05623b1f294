#include "kernels/non_finite.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace attention {
namespace {

// A value is Inf or NaN iff its exponent field is all ones (float8: see kE4m3): adding the
// exponent's lowest bit to the masked exponent then carries into the (masked-off) sign bit. Every
// element of a 64-bit word is tested at once (no carry crosses elements: the sum stays within each
// element's width).
using Bits = NonFiniteBits;
constexpr Bits kF32{0x7f8000007f800000u, 0x0080000000800000u, 0x8000000080000000u};
constexpr Bits kF16{0x7c007c007c007c00u, 0x0400040004000400u, 0x8000800080008000u};
constexpr Bits kBf16{0x7f807f807f807f80u, 0x0080008000800080u, 0x8000800080008000u};
// float8 e4m3 has no inf, and NaN is exponent and mantissa all ones (S.1111.111): the same test
// over the 7 bits below the sign.
constexpr Bits kE4m3{0x7f7f7f7f7f7f7f7fu, 0x0101010101010101u, 0x8080808080808080u};

// 4 KiB per block: a block's words are reduced with no branch (the compiler vectorises the loop),
// and the scan stops after the first block that holds a non-finite value.
constexpr size_t kBlockWords = 512;

bool WordsHoldNonFinite(const unsigned char* data, size_t words, const Bits& b) {
  for (size_t w0 = 0; w0 < words; w0 += kBlockWords) {
    const size_t n = words - w0 < kBlockWords ? words - w0 : kBlockWords;
    uint64_t any = 0;
    for (size_t i = 0; i < n; ++i) {
      uint64_t x;
      std::memcpy(&x, data + (w0 + i) * 8, 8);
      any |= ((x & b.exponent) + b.low) & b.sign;
    }
    if (any != 0) return true;
  }
  return false;
}

}  // namespace

NonFiniteBits NonFiniteBitsOf(DType dtype) {
  return dtype == DType::kFloat32      ? kF32
         : dtype == DType::kFloat16    ? kF16
         : dtype == DType::kFloat8E4M3 ? kE4m3
                                       : kBf16;
}

bool HoldsNonFinite(DType dtype, const void* data, int64_t elements) {
  if (elements <= 0) return false;
  const Bits b = NonFiniteBitsOf(dtype);
  const size_t bytes = static_cast<size_t>(elements) * DTypeSize(dtype);
  const auto* p = static_cast<const unsigned char*>(data);
  if (WordsHoldNonFinite(p, bytes / 8, b)) return true;
  // The last bytes (fewer than 8: whole elements), zero-padded to a word (zero is finite).
  uint64_t tail = 0;
  std::memcpy(&tail, p + bytes / 8 * 8, bytes % 8);
  return (((tail & b.exponent) + b.low) & b.sign) != 0;
}

}  // namespace attention
