// Times attention::cuda::Forward on device-resident inputs and prints one JSON line per shape:
//   cuda_attention_bench [--variant NAME] grid   the FlashAttention grid: float16 and bfloat16,
//                               D in {64,128,256}, N in {512..16384}, B = 16384/N, H = 2048/D,
//                               causal and not
//   cuda_attention_bench [--variant NAME] fp32   float32, B=16, H=12, D=64, N in {1024, 4096}
//   cuda_attention_bench [--variant NAME] one DTYPE D N CAUSAL   one shape of the grid
// --variant forces a forward kernel variant (ForwardVariantName, e.g. mma_sm80) instead of the
// planner's choice; each JSON line names the variant that ran ("variant").
// Each shape: random normal inputs (BHSD), 3 warm-up runs, then the median of 30 runs each timed
// with CUDA events. One input set is 3 x 200 MB for the grid (4x the 50 MB L2), so repeated runs
// do not run from the cache. run_bench.py times torch's SDPA on the same shapes beside it.
//
// Built as cuda_tile_sweep (ATTENTION_TILE_SWEEP; not part of the default build) the same program
// times candidate tile shapes of the bfloat16 kernel instead, one JSON line per (shape, tile):
//   cuda_tile_sweep [D N causal]...   default: D in {64, 128} x N in {1024, 2048, 4096, 16384},
//                                     causal and not
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/cuda/check_cuda.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/forward_plan.h"
#include "kernels/status_macros.h"
#ifdef ATTENTION_TILE_SWEEP
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/flash_forward_launch.cuh"
#endif

namespace {

using attention::AttentionParams;
using attention::DType;

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

using attention::cuda::ForwardVariant;

// Runs one forward pass and returns the kernel variant that ran it.
using Runner = std::function<absl::StatusOr<ForwardVariant>(const AttentionParams&)>;

// attention::cuda::Forward, forcing `variant` when set.
Runner ForwardRunner(std::optional<ForwardVariant> variant) {
  // The default stream's scratch: every launch here runs on it (kept for the whole process).
  static const absl::StatusOr<attention::cuda::ForwardScratch> scratch =
      attention::cuda::AllocateForwardScratch();
  return [variant](const AttentionParams& p) -> absl::StatusOr<ForwardVariant> {
    RETURN_IF_ERROR(scratch.status());
    ASSIGN_OR_RETURN(const attention::cuda::ForwardLaunch launch,
                     attention::cuda::PrepareForward(p, variant));
    RETURN_IF_ERROR(attention::cuda::LaunchForward(launch, nullptr, *scratch));
    return launch.plan.variant;
  };
}

// Times `run` on shape s; `label` (if any) is added to the JSON line as "tile".
bool TimeShape(const Shape& s, const Runner& run, const std::string& label = "") {
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
  ForwardVariant variant = ForwardVariant::kMmaSm80;
  for (int rep = 0; rep < 33 && ok; ++rep) {
    cudaEventRecord(start);
    absl::StatusOr<ForwardVariant> ran = run(p);
    cudaEventRecord(stop);
    if (!ran.ok()) {
      std::fprintf(stderr, "Forward: %s\n", std::string(ran.status().message()).c_str());
      ok = false;
      break;
    }
    variant = *ran;
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
        "\"variant\": \"%s\", %s\"ms\": %.4f, \"TFLOPs\": %.1f}\n",
        attention::DTypeName(s.dtype), (long long)s.d, (long long)s.n, (long long)s.b,
        (long long)s.h, s.causal ? "true" : "false",
        std::string(attention::cuda::ForwardVariantName(variant)).c_str(),
        label.empty() ? "" : ("\"tile\": \"" + label + "\", ").c_str(), median,
        flops / median / 1e9);
    std::fflush(stdout);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* b : buf) cudaFree(b);
  return ok;
}

#ifdef ATTENTION_TILE_SWEEP
// The tiles are the mma.sync kernel's (ForwardVariant::kMmaSm80).
template <typename Tile>
Runner TileRunner() {
  return [](const AttentionParams& p) -> absl::StatusOr<ForwardVariant> {
    ASSIGN_OR_RETURN(const attention::cuda::KernelParams kp, attention::cuda::ToKernelParams(p));
    RETURN_IF_CUDA_ERROR(attention::cuda::LaunchFlashTile<Tile>(kp, nullptr), "candidate tile");
    return ForwardVariant::kMmaSm80;
  };
}

// Candidate tiles (D, Br, Bc, warps[, mask variants]) per head dim, the production ones first
// (D=64: unmasked, masked).
template <int kD, int kBr, int kBc, int kWarps, bool kMaskVariants = false>
std::pair<std::string, Runner> Candidate() {
  using Tile = attention::cuda::FlashTile<__nv_bfloat16, kD, kBr, kBc, kWarps, kMaskVariants>;
  return {std::to_string(kBr) + "x" + std::to_string(kBc) + "_w" + std::to_string(kWarps) +
              (kMaskVariants ? "_maskvariants" : ""),
          TileRunner<Tile>()};
}

int Sweep(int argc, char** argv) {
  std::vector<Shape> shapes;
  for (int i = 1; i + 2 < argc; i += 3) {
    const int64_t d = std::atoll(argv[i]), n = std::atoll(argv[i + 1]);
    shapes.push_back({DType::kBFloat16, 16384 / n, 2048 / d, n, d, std::atoi(argv[i + 2]) != 0});
  }
  if (shapes.empty()) {
    for (int64_t d : {64, 128})
      for (int64_t n : {1024, 2048, 4096, 16384})
        for (bool causal : {false, true})
          shapes.push_back({DType::kBFloat16, 16384 / n, 2048 / d, n, d, causal});
  }
  const std::vector<std::pair<std::string, Runner>> d64 = {
      Candidate<64, 128, 64, 4>(),       Candidate<64, 64, 64, 4>(),
      Candidate<64, 128, 64, 4, true>(), Candidate<64, 64, 64, 4, true>(),
      Candidate<64, 64, 128, 4>(),       Candidate<64, 64, 128, 4, true>()};
  const std::vector<std::pair<std::string, Runner>> d128 = {Candidate<128, 128, 64, 4>(),
                                                            Candidate<128, 128, 64, 4, true>(),
                                                            Candidate<128, 128, 32, 4>()};
  for (const Shape& s : shapes) {
    for (const auto& [label, run] : s.d == 64 ? d64 : d128) {
      if (!TimeShape(s, run, label)) return 1;
    }
  }
  return 0;
}
#endif  // ATTENTION_TILE_SWEEP

}  // namespace

int main(int argc, char** argv) {
#ifdef ATTENTION_TILE_SWEEP
  return Sweep(argc, argv);
#endif
  const char* program = argv[0];
  std::optional<ForwardVariant> variant;
  if (argc > 2 && std::strcmp(argv[1], "--variant") == 0) {
    const absl::StatusOr<ForwardVariant> parsed = attention::cuda::ParseForwardVariant(argv[2]);
    if (!parsed.ok()) {
      std::fprintf(stderr, "--variant: %s\n", std::string(parsed.status().message()).c_str());
      return 2;
    }
    variant = *parsed;
    argc -= 2;
    argv += 2;
  }
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
  } else if (std::strcmp(which, "one") == 0 && argc == 6) {
    // one DTYPE D N CAUSAL: a single shape of the grid (B = 16384/N, H = 2048/D), for re-runs.
    const DType dt = std::strcmp(argv[2], "float16") == 0 ? DType::kFloat16 : DType::kBFloat16;
    const int64_t d = std::atoll(argv[3]), n = std::atoll(argv[4]);
    shapes.push_back({dt, 16384 / n, 2048 / d, n, d, std::strcmp(argv[5], "true") == 0});
  } else {
    std::fprintf(stderr,
                 "usage: %s [--variant NAME] grid|fp32|one {float16|bfloat16} D N {true|false}\n",
                 program);
    return 2;
  }
  const Runner run = ForwardRunner(variant);
  for (const Shape& s : shapes) {
    if (!TimeShape(s, run)) return 1;
  }
  return 0;
}
