// Whether a host tensor holds an Inf or NaN, by its exponent bits (all ones), without converting
// any element. The CUDA host runner asks it of V for masked requests
// (kernels/cuda/runtime/host_runner.h).
#pragma once

#include <cstdint>

#include "kernels/attention_params.h"

namespace attention {

// The bit test of one 64-bit word of `dtype` elements: ((x & exponent) + low) & sign is nonzero iff
// one of its elements is Inf or NaN (the exponent field all ones: adding its lowest bit carries
// into the masked-off sign bit; no carry crosses elements). Shared with the device-side scan
// (kernels/cuda/prep/non_finite_scan.h), so both sides answer alike.
struct NonFiniteBits {
  uint64_t exponent, low, sign;
};
NonFiniteBits NonFiniteBitsOf(DType dtype);

// Whether any of the `elements` values of `dtype` at `data` is an Inf or a NaN. Reads every byte
// (no early exit within 4 KiB blocks): ~memory bandwidth of one core.
bool HoldsNonFinite(DType dtype, const void* data, int64_t elements);

}  // namespace attention
