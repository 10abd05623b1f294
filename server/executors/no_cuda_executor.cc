// CUDA entry points for builds without the CUDA toolkit: no devices, and a clear error when one is
// asked for anyway.
#include "server/executors/executor.h"
#include "server/executors/host_memory.h"

namespace attention::server {

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int /*ordinal*/) {
  return absl::UnimplementedError("the cuda backend is not available: built without CUDA");
}

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal,
                                                           const CudaExecutorOptions& /*options*/) {
  return MakeCudaExecutor(ordinal);
}

int CudaDeviceCount() { return 0; }

std::unique_ptr<HostMemory> MakePinnedHostMemory(int64_t /*cache_bytes*/) {
  return MakePageableHostMemory();
}

}  // namespace attention::server
