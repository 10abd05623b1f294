// The opt-in to more than 48 KiB of dynamic shared memory, once per kernel and device: the
// attribute is the function's in each device's context and stays set, so only the first launch on
// a device pays the driver call (every decode step and forward launch made it before).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

namespace attention::cuda {

// `set_on`: one per kernel (a static of the kernel's launch function), bit d for device d.
// Devices past 63 make the call every time.
template <typename Kernel>
cudaError_t OptInSharedMemory(Kernel* kernel, int bytes, std::atomic<uint64_t>& set_on) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (set_on.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) set_on.fetch_or(bit, std::memory_order_release);
  return err;
}

}  // namespace attention::cuda
