// The CPU backend's paged KV pool (kernels/paged_kv.h): pages in host memory, decode steps on
// `threads` threads (0 = the CPUs this process may use).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/paged_kv.h"

namespace attention::cpu {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeKvPagePool(int64_t num_pages, int64_t page_bytes,
                                                           int threads);

}  // namespace attention::cpu
