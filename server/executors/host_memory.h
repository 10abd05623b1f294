// Host memory for a request's tensors and results, of the kind its executor reads fastest. The
// one host copy of a request's tensor bytes (from the bytes gRPC received) lands here, and the
// executor writes o and lse here, which gRPC then sends from in place:
//  - for the CPU backend, plain memory: the kernel reads and writes it directly;
//  - for the CUDA backend, page-locked (pinned) memory: the runner's DMAs read and write it
//    directly, skipping its staging buffers (kernels/cuda/runtime/host_runner.h). Pinning is slow
//    (the kernel pins page by page), so freed blocks are kept for reuse, up to a cap.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace attention::server {

class HostMemory {
 public:
  virtual ~HostMemory() = default;
  // `bytes` (> 0) of host memory, 256-byte aligned and not initialised, given back when the last
  // reference goes (it may outlive this object). RESOURCE_EXHAUSTED when the host has none left.
  virtual absl::StatusOr<std::shared_ptr<char>> Allocate(int64_t bytes) = 0;
};

std::unique_ptr<HostMemory> MakePageableHostMemory();

// Pinned memory that keeps up to `cache_bytes` of freed blocks for reuse; when the host cannot pin
// more, pageable memory instead (the runner then stages it). Without CUDA: pageable memory.
std::unique_ptr<HostMemory> MakePinnedHostMemory(int64_t cache_bytes);

}  // namespace attention::server
