// The paged KV pool tests on the CUDA backend's pool (GPU 0); they skip where no GPU is visible.
#include <cuda_runtime_api.h>

#include "kernels/cuda/paged_kv_pool.h"
#include "tests/kernels/paged_kv_pool_test.h"

namespace attention::kernel_test {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes) {
  return cuda::MakeKvPagePool(/*device=*/0, num_pages, page_bytes, {.poison_outputs = true});
}

std::string PoolUnavailableReason() {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return "";
  return "no CUDA device visible: GPU test skipped";
}

}  // namespace attention::kernel_test
