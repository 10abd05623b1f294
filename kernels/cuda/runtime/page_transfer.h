// The CUDA pool's host tier (kernels/paged_kv.h: AllocateHost, SavePages, LoadPages): pinned
// host memory, and the copies of whole pages between the pool's device memory and it on the
// pool's stream. Kept apart from paged_kv_pool.cc, which calls them under its lock.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/paged_kv.h"

namespace attention::cuda {

// `bytes` of pinned host memory (portable: every device's copies run at the link's rate),
// freed with cudaFreeHost when the last HostBuffer goes; RESOURCE_EXHAUSTED naming the bytes when
// the host has no such memory.
absl::StatusOr<HostBuffer> AllocatePinnedHost(int64_t bytes);

// Copies every page of `pages` between `pool` (device memory, page p at pool + p * page_bytes) and
// its host memory on `stream` (to the host: `to_host`), a page run at a time (pages consecutive in
// both places are one copy), and waits for the stream: stream order puts the copies after
// everything queued before, and once this returns the source may be reused.
absl::Status CopyHostPages(cudaStream_t stream, unsigned char* pool, int64_t page_bytes,
                           absl::Span<const HostPage> pages, bool to_host);

}  // namespace attention::cuda
