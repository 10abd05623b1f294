#include "kernels/cuda/ops/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace attention::cuda {

absl::Status CudaError(cudaError_t err, absl::string_view what) {
  const std::string message = absl::StrCat("cuda backend: ", what, ": ", cudaGetErrorName(err),
                                           ": ", cudaGetErrorString(err));
  // Reported once: a later launch check (cudaGetLastError) must not report this error again as
  // its own. A sticky error (the context is lost) stays: every later call still returns it.
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  return err == cudaSuccess ? absl::OkStatus() : CudaError(err, what);
}

}  // namespace attention::cuda
