// wgmma shared-memory matrix descriptors (flash_forward_sm90_kernel.cuh builds them), shared with
// a host-side test (tests/kernels/cuda_plan_test.cc) of the arithmetic the kernel relies on.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace attention::cuda {

// A shared-memory matrix descriptor for the 128-byte swizzle (the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: rows of 128 bytes, 16-byte chunk c of row r at c ^ (r % 8), in
// 1024-byte groups of 8 rows that start 1024-byte aligned). Byte offsets: `lbo` between 64-element
// blocks along M/N (MN-major operands; K-major ones ignore it), `sbo` between 8-row groups.
ATTENTION_HOST_DEVICE inline uint64_t SmemDesc128B(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;
}

// `desc` with its address field (bytes / 16, bits 0-13) moved on by `units`, through the low word
// alone: equal to the descriptor built at the moved address while that address stays below
// 2^18 (every shared address does: Sm90Tile asserts its size), so the field never carries into
// the next one. A wgmma k-step's operand is its tile's first one a constant number of bytes on,
// so this keeps the descriptor arithmetic per wgmma to one addition.
ATTENTION_HOST_DEVICE inline uint64_t DescPlus(uint64_t desc, uint32_t units) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + units);
}

}  // namespace attention::cuda
