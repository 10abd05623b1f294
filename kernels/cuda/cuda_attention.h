// The CUDA backend's forward pass (see flash_forward_kernel.cuh for the kernel and
// flash_forward_launch.cuh for its tiles and measured speed).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/kernel_params.h"

namespace attention::cuda {

// Enqueues attention on `stream`. q, k, v, o, lse and cu_seqlens_* are device pointers. Returns
// at once; the result is ready when the stream reaches this point. Every CUDA error becomes a
// Status naming it.
absl::Status Forward(const AttentionParams& p, cudaStream_t stream);

// The checks and the conversion Forward does before it launches: the kernels' view of `p`, or the
// error Forward would return. (The tile sweep in bench/cuda launches other tiles with it.)
absl::StatusOr<KernelParams> ToKernelParams(const AttentionParams& p);

}  // namespace attention::cuda
