// The CUDA backend's paged KV pool (kernels/paged_kv.h): one device allocation of pages on GPU
// `device`, decode steps by split-KV kernels (kernels/cuda/paged_decode_*).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/paged_kv.h"

namespace attention::cuda {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeKvPagePool(int device, int64_t num_pages,
                                                            int64_t page_bytes);

}  // namespace attention::cuda
