// CHECK_CUDA(expr) for the bench programs' bool functions: prints the failed call and its CUDA
// error, and returns false.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    if (cudaError_t err_ = (expr); err_ != cudaSuccess) {                \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_)); \
      return false;                                                      \
    }                                                                    \
  } while (0)
