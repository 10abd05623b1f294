// Many small copies in one launch: the CUDA KV pool's writes (paged_kv_pool.cc) stage a step's new
// K/V rows packed in one pinned buffer and scatter its segments to their pages here, the kernel
// reading the staging over the bus, where one cudaMemcpy2DAsync per page run, K or V, and sequence
// took a call and a copy-engine job each (and a copy of the staging to the device, one more).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attention::cuda {

// Bytes [src, src + bytes) of the staged buffer go to [dst, dst + bytes) of the pool.
struct KvSegment {
  int64_t src;
  int64_t dst;
  int64_t bytes;
};

// Copies `count` segments from `src` to `dst` (a device buffer) on `stream`, a CTA per segment, in
// units of `unit` bytes (16, 8, 4 or 2; every src, dst and bytes a multiple of it). `segments`
// and `src` are device memory or pinned host memory (the device reads it over the bus).
cudaError_t LaunchKvScatter(const KvSegment* segments, int64_t count, const unsigned char* src,
                            unsigned char* dst, int unit, cudaStream_t stream);

}  // namespace attention::cuda
