// float8 e4m3 -> bfloat16 on the device: how the CUDA backend serves float8 inputs on kernels that
// take bfloat16 (the mma.sync forward). Every e4m3 value is exact in bfloat16 (kernels/float8.h),
// so the conversion loses nothing; the descale factors are not applied here but folded into the
// forward kernel's logit scale and output normalisation (KernelParams::scale_log2, o_scale),
// where they cost float32 rounding only. Scaling V here instead would round each v * v_descale to
// bfloat16's 8 significant bits unless v_descale is a power of two: a third bfloat16 rounding
// beside P's and o's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attention::cuda {

// dst[0, n) = bfloat16(e4m3 src[0, n)), exactly (NaN stays NaN), on `stream`. src and dst are
// device memory of the current device, any alignment; returns cudaGetLastError() of the launch.
cudaError_t LaunchDequantiseE4m3ToBf16(const void* src, void* dst, int64_t n, cudaStream_t stream);

}  // namespace attention::cuda
