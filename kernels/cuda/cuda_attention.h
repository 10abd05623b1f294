// The CUDA backend's forward pass (see flash_forward_kernel.cuh for the kernel and
// flash_forward_launch.cuh for its tiles and measured speed).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kernels/attention_params.h"

namespace attention::cuda {

// Enqueues attention on `stream`. q, k, v, o, lse and cu_seqlens_* are device pointers. Returns
// at once; the result is ready when the stream reaches this point. Every CUDA error becomes a
// Status naming it.
absl::Status Forward(const AttentionParams& p, cudaStream_t stream);

}  // namespace attention::cuda
