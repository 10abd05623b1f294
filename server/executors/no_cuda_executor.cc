// CUDA entry points for builds without the CUDA toolkit: no devices, and a clear error when one is
// asked for anyway.
#include "server/executors/executor.h"

namespace attention::server {

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int /*ordinal*/) {
  return absl::UnimplementedError("the cuda backend is not available: built without CUDA");
}

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal,
                                                           const CudaExecutorOptions& /*options*/) {
  return MakeCudaExecutor(ordinal);
}

int CudaDeviceCount() { return 0; }

}  // namespace attention::server
