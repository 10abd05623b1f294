// CUDA errors as absl::Status, the one way kernels/cuda reports them: the code follows the error
// (an allocation failure is RESOURCE_EXHAUSTED, so a caller may retry smaller or later; every
// other error INTERNAL) and the message names the CUDA error and what was being done.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention::cuda {

// err != cudaSuccess as a Status: "cuda backend: <what>: <error name>: <description>",
// RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation, INTERNAL otherwise. It clears the error from
// cudaGetLastError: a non-sticky error (an allocation failure, an invalid argument) is reported
// once, not again by a later launch check as that launch's.
absl::Status CudaError(cudaError_t err, absl::string_view what);

// OK for cudaSuccess, else CudaError(err, what).
absl::Status CudaStatus(cudaError_t err, absl::string_view what);

}  // namespace attention::cuda

// Returns CudaError(err, what) from the enclosing function (returning absl::Status or
// absl::StatusOr) when `expr` yields a cudaError_t other than cudaSuccess.
#define RETURN_IF_CUDA_ERROR(expr, what)                                                \
  do {                                                                                  \
    if (const cudaError_t cuda_status_err_ = (expr); cuda_status_err_ != cudaSuccess) { \
      return ::attention::cuda::CudaError(cuda_status_err_, what);                      \
    }                                                                                   \
  } while (0)
