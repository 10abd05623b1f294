// What the CUDA planners (PlanFlashForward, the paged decode pool's PlanPagedDecode options) need
// to know of a device, queried once per device and cached.
#pragma once

#include "absl/status/statusor.h"

namespace attention::cuda {

struct DeviceCaps {
  int compute_capability = 0;    // major * 10 + minor: 80 for A100, 90 for H100 and H200
  int sm_count = 0;              // multiprocessors
  int smem_per_block_optin = 0;  // bytes of shared memory a block may opt in to
};

// The caps of CUDA device `device`, queried on first use and cached (thread-safe); a failed query
// is not cached.
absl::StatusOr<DeviceCaps> GetDeviceCaps(int device);
// GetDeviceCaps of the calling thread's current device (cudaGetDevice).
absl::StatusOr<DeviceCaps> CurrentDeviceCaps();

}  // namespace attention::cuda
