// The paged KV pool tests (paged_kv_pool_test.cc) are one source for every backend: each test
// binary links them with its own pool factory below (paged_kv_cpu_test.cc, paged_kv_cuda_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/paged_kv.h"

namespace attention::kernel_test {

// A fresh pool of the backend under test.
absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes);
// Empty when the backend can run here; otherwise why not (the tests skip with it).
std::string PoolUnavailableReason();

// The memory of the GPU the backend's pool is on, for steps whose tensors are there
// (StepMemory::on_device). All unset where the backend has none (its pool must refuse them).
struct PoolDeviceMemory {
  std::function<void*(const void* host, size_t bytes)> upload;  // a new buffer holding the bytes
  std::function<void(void* host, const void* device, size_t bytes)> download;
  std::function<void(void* device)> free;  // once the device's queued work is done
  // An event recorded now (a caller's `ready`: its uploads are done), and one to pass as `done`.
  std::function<void*()> recorded_event;
  std::function<void*()> new_event;
  // Waits for the event's last record, then destroys it.
  std::function<void(void* event)> synchronize;
};
PoolDeviceMemory TestPoolDeviceMemory();

}  // namespace attention::kernel_test
