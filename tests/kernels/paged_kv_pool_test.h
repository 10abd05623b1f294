// The paged KV pool tests (paged_kv_pool_test.cc) are one source for every backend: each test
// binary links them with its own pool factory below (paged_kv_cpu_test.cc, paged_kv_cuda_test.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/paged_kv.h"

namespace attention::kernel_test {

// A fresh pool of the backend under test.
absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes);
// Empty when the backend can run here; otherwise why not (the tests skip with it).
std::string PoolUnavailableReason();
// Whether the backend's decode serves sinks, softcap and chunk_size (else it must refuse them
// UNIMPLEMENTED).
bool PoolServesOpenModelOptions();

}  // namespace attention::kernel_test
