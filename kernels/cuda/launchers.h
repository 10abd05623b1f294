// Kernel launchers, one per dtype, callable from plain C++ (cuda_attention.cc turns their
// cudaError_t into a Status). Each picks the head-dim specialisation, raises the dynamic
// shared-memory limit, launches on `stream` and returns cudaGetLastError().
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/kernel_params.h"

namespace attention::cuda {

// The head dims with their own tile shapes; any smaller multiple of 8 runs in the next one up.
inline constexpr int kSpecialisedHeadDims[] = {64, 128, 256};
inline constexpr int kMaxHeadDim = 256;

// float16 / bfloat16 tensor-core kernel (flash_forward.cu). head_dim % 8 == 0, <= 256.
cudaError_t LaunchFlashForwardF16(const KernelParams& p, cudaStream_t stream);
cudaError_t LaunchFlashForwardBF16(const KernelParams& p, cudaStream_t stream);
// float32 through the same kernel with 3xTF32 mma (flash_forward_f32.cu). head_dim % 8 == 0.
cudaError_t LaunchForwardF32(const KernelParams& p, cudaStream_t stream);

}  // namespace attention::cuda
