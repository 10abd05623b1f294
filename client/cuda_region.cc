#include "client/cuda_region.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace attention::client {
namespace {

absl::Status CudaFailure(cudaError_t err, const char* what) {
  cudaGetLastError();
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

}  // namespace

absl::StatusOr<CudaIpcHandle> GetCudaIpcHandle(const void* device_ptr) {
  cudaPointerAttributes attr;
  if (cudaError_t err = cudaPointerGetAttributes(&attr, device_ptr); err != cudaSuccess) {
    return CudaFailure(err, "cudaPointerGetAttributes");
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("device_ptr: expected memory from cudaMalloc");
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t err = cudaIpcGetMemHandle(&handle, const_cast<void*>(device_ptr));
      err != cudaSuccess) {
    return CudaFailure(err, "cudaIpcGetMemHandle");
  }
  return CudaIpcHandle{std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)),
                       attr.device};
}

absl::StatusOr<v1::RegionInfo> RegisterCudaAllocation(SharedMemoryClient& regions,
                                                      const std::string& name,
                                                      const void* device_ptr, int64_t bytes,
                                                      const CallOptions& call) {
  absl::StatusOr<CudaIpcHandle> h = GetCudaIpcHandle(device_ptr);
  if (!h.ok()) return h.status();
  return regions.RegisterCuda(name, h->handle, h->device, 0, bytes, call);
}

}  // namespace attention::client
