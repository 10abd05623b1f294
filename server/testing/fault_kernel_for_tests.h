// Test support: puts device `device`'s CUDA context into a sticky error state, as a faulting
// kernel would. Only for tests that run in a process of their own: nothing works on the device
// afterwards.
#ifndef ATTENTION_SERVER_FAULT_KERNEL_FOR_TESTS_H_
#define ATTENTION_SERVER_FAULT_KERNEL_FOR_TESTS_H_

#include <cuda_runtime_api.h>

namespace attention::server {

// Launches a kernel that writes through an invalid pointer and waits; returns the error
// (cudaErrorIllegalAddress on the GPUs we know).
cudaError_t CorruptContextForTests(int device);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_FAULT_KERNEL_FOR_TESTS_H_
