// Addressing of the swizzled shared-memory tiles that the forward and the paged decode kernels
// share: rows of kRowBytes = kChunks x 16 bytes, chunk c of row r stored at c ^ (r % 8), so the 8
// row addresses of every ldmatrix phase and every cp.async warp store hit 8 different 16-byte bank
// groups (no bank conflicts, no padding). Rows need >= 8 chunks (head dims that are multiples of
// 64 for 16-bit types).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attention::cuda {

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
template <int kRowBytes>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// ldmatrix.x4 over two adjacent chunks (2j, 2j + 1) of 16 rows: each lane gives one row address.
// With lane_off = SwizzledOffset(row, sel) for the lane's row and chunk sel in {0, 1}, the
// address of pair j is lane_off ^ ((j % 4) << 5) + (j / 4) * 128: chunk 2j + sel is swizzled
// into bits 4-6 of the offset only, and row * kRowBytes is a multiple of 128. For compile-time j
// that is one of four loop-invariant registers plus an immediate, with no per-access index math.
__device__ __forceinline__ uint32_t PairOffset(uint32_t lane_off, int j) {
  return (lane_off ^ static_cast<uint32_t>((j & 3) << 5)) + static_cast<uint32_t>((j >> 2) << 7);
}

// Zeroes the Inf and NaN elements of a 16-byte chunk of T (__half, __nv_bfloat16 or float);
// returns whether it held any. The paged decode kernel checks the V rows of tiles on a window edge
// with it (see its opening comment): P V must not multiply a masked key's P = 0 by a non-finite V.
template <typename T>
__device__ __forceinline__ bool ZeroNonFinite(uint4& chunk) {
  // Exponent bits (all ones: Inf or NaN) of each element of a 32-bit word.
  constexpr uint32_t kExponent = std::is_same_v<T, float>    ? 0x7f800000u
                                 : std::is_same_v<T, __half> ? 0x7c007c00u
                                                             : 0x7f807f80u;
  constexpr uint32_t kLow = sizeof(T) == 4 ? 0xffffffffu : 0x0000ffffu;  // first element's bits
  uint32_t w[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t e = w[i] & kExponent;
    uint32_t keep = 0xffffffffu;
    if ((e & kLow) == (kExponent & kLow)) keep &= ~kLow;
    if (sizeof(T) == 2 && (e & ~kLow) == (kExponent & ~kLow)) keep &= kLow;
    any |= keep != 0xffffffffu;
    w[i] &= keep;
  }
  chunk = make_uint4(w[0], w[1], w[2], w[3]);
  return any;
}

}  // namespace attention::cuda
