// The CUDA backend's paged KV pool (kernels/paged_kv.h): one device allocation of pages on GPU
// `device`, decode steps by split-KV kernels (kernels/cuda/decode/).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/paged_kv.h"

namespace attention::cuda {

struct CudaKvPoolOptions {
  // Fill o (and lse) with NaN before each step's kernel, so an element it misses shows (tests);
  // off, a step pays for no memsets.
  bool poison_outputs = false;
  // > 0: every step runs this many splits (at most one per key tile) instead of the planner's
  // choice, so tests reach split counts the planner would not pick for their shapes.
  int splits = 0;
  // false: split CTAs merge through global memory even on a device with thread-block clusters
  // (tests reach both merges; kernels/cuda/decode/paged_decode.h).
  bool clusters = true;
  // How long the stream waits for a caller's ready_counter or ready_event before going on without
  // it (counter_waits.h).
  absl::Duration stream_wait_timeout = absl::Seconds(60);
};

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeKvPagePool(int device, int64_t num_pages,
                                                           int64_t page_bytes,
                                                           const CudaKvPoolOptions& options = {});

}  // namespace attention::cuda
