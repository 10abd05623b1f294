// ATTENTION_HOST_DEVICE marks functions that host code and CUDA device code share (one copy for
// both; plain C++17 with no library call that device code lacks): __host__ __device__ under nvcc,
// nothing in plain C++.
#pragma once

#if defined(__CUDACC__)
#define ATTENTION_HOST_DEVICE __host__ __device__
#else
#define ATTENTION_HOST_DEVICE
#endif
