// The paged KV pool tests on the CPU backend's pool (two threads, so the split merge runs).
#include "kernels/cpu/paged_kv_pool.h"
#include "tests/kernels/paged_kv_pool_test.h"

namespace attention::kernel_test {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes) {
  return cpu::MakeKvPagePool(num_pages, page_bytes, /*threads=*/2);
}

std::string PoolUnavailableReason() { return ""; }

PoolDeviceMemory TestPoolDeviceMemory() { return {}; }

}  // namespace attention::kernel_test
