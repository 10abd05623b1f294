// Many small device-to-device copies in one launch: the CUDA KV pool's writes (paged_kv_pool.cc)
// stage a step's new K/V rows packed in one buffer, copy it to the device at once, and scatter
// its segments to their pages here, where one cudaMemcpy2DAsync per page run, K or V, and
// sequence took a call and a copy-engine job each.
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

// Copies `count` segments (a device array) from `src` to `dst` (device buffers) on `stream`, a
// CTA per segment, in units of `unit` bytes (16, 8, 4 or 2; every src, dst and bytes a multiple
// of it).
cudaError_t LaunchKvScatter(const KvSegment* segments, int64_t count, const unsigned char* src,
                            unsigned char* dst, int unit, cudaStream_t stream);

}  // namespace attention::cuda
