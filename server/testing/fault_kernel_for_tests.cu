// A kernel that writes through an invalid device pointer: the "sticky" CUDA error (the context is
// unusable until the process exits) that the device-loss test needs.
#include <cstdint>

#include "server/testing/fault_kernel_for_tests.h"

namespace attention::server {
namespace {

__global__ void WriteThroughInvalidPointer(int* p) { *p = 1; }

}  // namespace

cudaError_t CorruptContextForTests(int device) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) return err;
  // No allocation lives at 256: the write faults (cudaErrorIllegalAddress).
  WriteThroughInvalidPointer<<<1, 1>>>(reinterpret_cast<int*>(uintptr_t{256}));
  return cudaDeviceSynchronize();
}

}  // namespace attention::server
