// The paged KV pool tests on the CUDA backend's pool (GPU 0); they skip where no GPU is visible.
// ATTENTION_TEST_SPLITS=N runs every step with N splits instead of the planner's (at most one
// per key tile): the planner gives these small shapes as many splits as they have key tiles, the
// decode bench's shapes two; ATTENTION_TEST_CLUSTERS=0 merges splits through global memory even
// where the GPU has thread-block clusters. bench/cuda/decode_device_run.sh runs the suite as
// planned, with 2 and 3 splits, and with 2 splits without clusters.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cuda/runtime/paged_kv_pool.h"
#include "tests/kernels/paged_kv_pool_test.h"

namespace attention::kernel_test {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes) {
  const char* splits = std::getenv("ATTENTION_TEST_SPLITS");
  const char* clusters = std::getenv("ATTENTION_TEST_CLUSTERS");
  return cuda::MakeKvPagePool(
      /*device=*/0, num_pages, page_bytes,
      {.poison_outputs = true,
       .splits = splits != nullptr && *splits != '\0' ? std::atoi(splits) : 0,
       .clusters = clusters == nullptr || std::string(clusters) != "0"});
}

std::string PoolUnavailableReason() {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return "";
  return "no CUDA device visible: GPU test skipped";
}

bool PoolServesOpenModelOptions() { return false; }

PoolDeviceMemory TestPoolDeviceMemory() {
  // GPU 0, the pool's; failures abort (a test helper with no status to return).
  auto check = [](cudaError_t err) {
    if (err != cudaSuccess) {
      std::fprintf(stderr, "CUDA error in a test helper: %s\n", cudaGetErrorString(err));
      std::abort();
    }
  };
  auto new_event = [check] {
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return static_cast<void*>(event);
  };
  return {.upload =
              [check](const void* host, size_t bytes) {
                void* device = nullptr;
                check(cudaMalloc(&device, bytes));
                check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
                return device;
              },
          .download =
              [check](void* host, const void* device, size_t bytes) {
                check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
              },
          .free =
              [check](void* device) {
                check(cudaDeviceSynchronize());
                check(cudaFree(device));
              },
          .recorded_event =
              [check, new_event] {
                void* event = new_event();
                check(cudaEventRecord(static_cast<cudaEvent_t>(event), cudaStreamLegacy));
                return event;
              },
          .new_event = new_event,
          .synchronize =
              [check](void* event) {
                check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
                check(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
              }};
}

}  // namespace attention::kernel_test
