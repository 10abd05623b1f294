// Whether a tensor in device memory holds an Inf or NaN, by the exponent bits (all ones), on the
// device: the device-side twin of kernels/non_finite.h, with the same bit test (its masks come
// from NonFiniteBitsOf), so a tensor answers the same on either side. The host runner asks it of V
// for masked requests whose V is in device memory (a client's CUDA IPC region), which would
// otherwise have to come to the host to be scanned (kernels/cuda/runtime/host_runner.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/non_finite.h"

namespace attention::cuda {

// Sets *flag (device memory, zeroed by the caller) to a nonzero value when any of the `elements`
// values at device address `data` (aligned to the element size `elem_bytes`) is Inf or NaN by
// `bits`; enqueued on `stream`. Reads every byte once at about the device's memory bandwidth
// (16-byte loads over the aligned middle, element loads at the two ends).
cudaError_t LaunchNonFiniteScan(const void* data, int64_t elements, int elem_bytes,
                                const NonFiniteBits& bits, unsigned int* flag, cudaStream_t stream);

}  // namespace attention::cuda
