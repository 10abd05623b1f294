// Times attention::cuda::Forward on device-resident inputs and prints one JSON line per shape:
//   cuda_attention_bench grid   the FlashAttention grid: float16 and bfloat16, D in {64,128,256},
//                               N in {512..16384}, B = 16384/N, H = 2048/D, causal and not
//   cuda_attention_bench fp32   float32, B=16, H=12, D=64, N in {1024, 4096}
// Each shape: random normal inputs (BHSD), 3 warm-up runs, then the median of 30 runs each timed
// with CUDA events. One input set is 3 x 200 MB for the grid (4x the 50 MB L2), so repeated runs
// do not run from the cache. run_bench.py times torch's SDPA on the same shapes beside it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/cuda/cuda_attention.h"

namespace {

using attention::AttentionParams;
using attention::DType;

#define CHECK_CUDA(expr)                                                         \
  do {                                                                           \
    if (cudaError_t err_ = (expr); err_ != cudaSuccess) {                        \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_));         \
      return false;                                                              \
    }                                                                            \
  } while (0)

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Standard normal values (Box-Muller on a hash of the index) as float, half or bfloat16 bits.
__global__ void FillNormal(void* out, int64_t n, int elem_bytes, int kind, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = (Hash(seed ^ (2 * i)) + 1.0f) * 2.3283064e-10f;
    const float u2 = Hash(seed ^ (2 * i + 1)) * 2.3283064e-10f;
    const float x = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    if (elem_bytes == 4) {
      static_cast<float*>(out)[i] = x;
    } else if (kind == 1) {
      static_cast<__half*>(out)[i] = __float2half_rn(x);
    } else {
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
    }
  }
}

struct Shape {
  DType dtype;
  int64_t b, h, n, d;
  bool causal;
};

bool TimeShape(const Shape& s) {
  AttentionParams p;
  p.dtype = s.dtype;
  p.batch = s.b;
  p.heads_q = p.heads_kv = s.h;
  p.seqlen_q = p.seqlen_k = s.n;
  p.head_dim = s.d;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  p.window_right = s.causal ? 0 : attention::kUnboundedWindow;
  p.SetContiguousStrides(attention::Layout::kBHSD);
  const int64_t elems = s.b * s.h * s.n * s.d;
  const size_t bytes = elems * attention::DTypeSize(s.dtype);
  void* buf[4];
  for (void*& b : buf) CHECK_CUDA(cudaMalloc(&b, bytes));
  const int kind = s.dtype == DType::kFloat16 ? 1 : 2;
  for (int i = 0; i < 3; ++i) {
    FillNormal<<<1024, 256>>>(buf[i], elems, attention::DTypeSize(s.dtype), kind, 1234 + i);
  }
  CHECK_CUDA(cudaGetLastError());
  p.q = buf[0];
  p.k = buf[1];
  p.v = buf[2];
  p.o = buf[3];

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  bool ok = true;
  for (int rep = 0; rep < 33 && ok; ++rep) {
    cudaEventRecord(start);
    absl::Status st = attention::cuda::Forward(p, nullptr);
    cudaEventRecord(stop);
    if (!st.ok()) {
      std::fprintf(stderr, "Forward: %s\n", std::string(st.message()).c_str());
      ok = false;
      break;
    }
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    if (rep >= 3) ms.push_back(t);
  }
  if (ok) {
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    double flops = 4.0 * s.b * s.h * s.n * s.n * s.d;
    if (s.causal) flops /= 2;
    std::printf(
        "{\"dtype\": \"%s\", \"d\": %lld, \"N\": %lld, \"B\": %lld, \"H\": %lld, \"causal\": %s, "
        "\"ms\": %.4f, \"TFLOPs\": %.1f}\n",
        attention::DTypeName(s.dtype), (long long)s.d, (long long)s.n, (long long)s.b,
        (long long)s.h, s.causal ? "true" : "false", median, flops / median / 1e9);
    std::fflush(stdout);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* b : buf) cudaFree(b);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "grid";
  std::vector<Shape> shapes;
  if (std::strcmp(which, "fp32") == 0) {
    for (int64_t n : {1024, 4096}) shapes.push_back({DType::kFloat32, 16, 12, n, 64, false});
  } else if (std::strcmp(which, "grid") == 0) {
    for (DType dt : {DType::kBFloat16, DType::kFloat16})
      for (int64_t d : {64, 128, 256})
        for (int64_t n : {512, 1024, 2048, 4096, 8192, 16384})
          for (bool causal : {false, true})
            shapes.push_back({dt, 16384 / n, 2048 / d, n, d, causal});
  } else {
    std::fprintf(stderr, "usage: %s grid|fp32\n", argv[0]);
    return 2;
  }
  for (const Shape& s : shapes) {
    if (!TimeShape(s)) return 1;
  }
  return 0;
}
