// Whether a host tensor holds an Inf or NaN, by its exponent bits (all ones), without converting
// any element. The CUDA host runner asks it of V for masked requests (kernels/cuda/host_runner.h).
#pragma once

#include <cstdint>

#include "kernels/attention_params.h"

namespace attention {

// Whether any of the `elements` values of `dtype` at `data` is an Inf or a NaN. Reads every byte
// (no early exit within 4 KiB blocks): ~memory bandwidth of one core.
bool HoldsNonFinite(DType dtype, const void* data, int64_t elements);

}  // namespace attention
