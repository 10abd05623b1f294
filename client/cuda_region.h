// CUDA regions from C++ (attention.v1.SharedMemory with cuda_ipc_handle): a client whose tensors
// are already on the server's GPU registers their allocation by its CUDA IPC handle, and the
// server reads and writes them in place. Needs the CUDA runtime (library attention_client_cuda).
//
//   void* dev;  cudaMalloc(&dev, bytes);                          // q, k, v, o inside
//   RegisterCudaAllocation(regions, "gpu", dev, bytes);          // regions: SharedMemoryClient
//   *request.mutable_q()->mutable_ref() = MakeRef("gpu", 0, q_bytes);   // and shape, dtype
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/shared_memory.h"

namespace attention::client {

// The cudaIpcMemHandle_t bytes of the allocation holding `device_ptr`, and that allocation's
// ordinal; an error naming the CUDA call that failed.
struct CudaIpcHandle {
  std::string handle;
  int device = 0;
};
absl::StatusOr<CudaIpcHandle> GetCudaIpcHandle(const void* device_ptr);

// Registers bytes [0, bytes) of the cudaMalloc allocation starting at `device_ptr` as `name`.
absl::StatusOr<v1::RegionInfo> RegisterCudaAllocation(SharedMemoryClient& regions,
                                                      const std::string& name,
                                                      const void* device_ptr, int64_t bytes,
                                                      const CallOptions& call = {});

}  // namespace attention::client
