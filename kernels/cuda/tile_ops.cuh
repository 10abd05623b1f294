// Addressing of the swizzled shared-memory tiles that the forward and the paged decode kernels
// share: rows of kRowBytes = kChunks x 16 bytes, chunk c of row r stored at c ^ (r % 8), so the 8
// row addresses of every ldmatrix phase and every cp.async warp store hit 8 different 16-byte bank
// groups (no bank conflicts, no padding). Rows need >= 8 chunks (head dims that are multiples of
// 64 for 16-bit types).
#pragma once

#include <cstdint>

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

}  // namespace attention::cuda
