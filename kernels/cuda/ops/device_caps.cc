#include "kernels/cuda/ops/device_caps.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "kernels/cuda/ops/cuda_status.h"

namespace attention::cuda {

absl::StatusOr<DeviceCaps> GetDeviceCaps(int device) {
  // Never destroyed: callers may plan until the process ends.
  static std::mutex* const mu = new std::mutex;
  static std::map<int, DeviceCaps>* const cache = new std::map<int, DeviceCaps>;
  std::lock_guard<std::mutex> lock(*mu);
  if (auto it = cache->find(device); it != cache->end()) return it->second;
  int major = 0, minor = 0;
  DeviceCaps caps;
  RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                       "cudaDeviceGetAttribute");
  RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                       "cudaDeviceGetAttribute");
  RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&caps.sm_count, cudaDevAttrMultiProcessorCount, device),
      "cudaDeviceGetAttribute");
  RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&caps.smem_per_block_optin,
                                              cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                       "cudaDeviceGetAttribute");
  caps.compute_capability = major * 10 + minor;
  cache->emplace(device, caps);
  return caps;
}

absl::StatusOr<DeviceCaps> CurrentDeviceCaps() {
  int device = 0;
  RETURN_IF_CUDA_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  return GetDeviceCaps(device);
}

}  // namespace attention::cuda
