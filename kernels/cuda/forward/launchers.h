// Kernel launchers of the forward kernels (ForwardVariant), one per variant and dtype, callable
// from plain C++ (cuda_attention.cc turns their cudaError_t into a Status). Each picks the
// head-dim specialisation (kSpecialisedHeadDims), raises the dynamic shared-memory limit, launches
// on `stream` and returns cudaGetLastError().
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/limits.h"

namespace attention::cuda {

// float16 / bfloat16 tensor-core kernel (flash_forward.cu). head_dim % 8 == 0, <= 256.
cudaError_t LaunchFlashForwardF16(const KernelParams& p, cudaStream_t stream);
cudaError_t LaunchFlashForwardBF16(const KernelParams& p, cudaStream_t stream);
// float32 through the same kernel with 3xTF32 mma (flash_forward_f32.cu). head_dim % 8 == 0.
cudaError_t LaunchForwardF32(const KernelParams& p, cudaStream_t stream);
// The Hopper kernel (ForwardVariant::kWgmmaSm90, flash_forward_sm90_kernel.cuh): float16 and
// bfloat16, head_dim % 8 == 0, <= 256; sm_90a only (elsewhere the kernel is empty).
cudaError_t LaunchFlashForwardSm90F16(const KernelParams& p, cudaStream_t stream);
cudaError_t LaunchFlashForwardSm90BF16(const KernelParams& p, cudaStream_t stream);
// float8 e4m3 on the Hopper kernel: head_dim % 16 == 0 in (64, 256], dense (not varlen), and
// p.v_transposed holding ForwardPlan::workspace_bytes (V transposed there first).
cudaError_t LaunchFlashForwardSm90F8(const KernelParams& p, cudaStream_t stream);
// The dynamic shared memory (bytes) each launcher's kernel takes at head_dim: the planner checks
// it against the device's opt-in limit per block. No CUDA call.
int FlashForwardSmemBytesF16(int head_dim);
int FlashForwardSmemBytesBF16(int head_dim);
int FlashForwardSmemBytesF32(int head_dim);
int FlashForwardSm90SmemBytes(int head_dim);  // float16 and bfloat16 alike; the largest tile's
int FlashForwardSm90F8SmemBytes(int head_dim);

}  // namespace attention::cuda
