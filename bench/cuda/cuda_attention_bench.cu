// Times attention::cuda::Forward on device-resident inputs and prints one JSON line per shape:
//   cuda_attention_bench [--variant NAME] [--list] grid   the FlashAttention grid: float16 and
//                               bfloat16, D in {64,128,256}, N in {512..16384}, B = 16384/N,
//                               H = 2048/D, causal and not
//   cuda_attention_bench [--variant NAME] [--list] fp8    float8 e4m3 inputs (o in bfloat16),
//                               descales 1, D in {128, 256}, N in {1024, 4096, 16384}, B and H
//                               as the grid, causal and not
//   cuda_attention_bench [--variant NAME] [--list] fp32   float32, B=16, H=12, D=64, N in
//                               {1024, 4096}
//   cuda_attention_bench [--variant NAME] one DTYPE D N CAUSAL   one shape of the grid (DTYPE
//                               float16, bfloat16 or float8_e4m3)
//   cuda_attention_bench [--variant NAME] [--list] options   the grid's shapes, each timed plain
//                               and then with each open-model option (softcap, sinks, chunk: the
//                               kernels' options instances), one line per (shape, option) with
//                               "slowdown" = option ms / plain ms
// --sustain_s S runs each shape back to back for S seconds before timing it, so the timed runs see
// the clocks the GPU holds under sustained load (a server kept busy), not those of a rested one.
// --option NAME (softcap, sinks or chunk) times every shape with that option set: softcap 50
// (Gemma 2's), sinks 0.5 for every head, chunks of N keys (Llama 4's kind of mask, cutting no key
// here, so that the time is the option's cost alone: the options instance against the plain one).
// --variant forces a forward kernel variant (ForwardVariantName, e.g. mma_sm80) instead of the
// planner's choice; each JSON line names the variant that ran ("variant"). --list prints the
// shapes (dtype, d, N, B, H, causal) without running anything, so no GPU is needed.
// Each shape: random normal inputs (BHSD), 3 warm-up runs, then the median of 30 runs each timed
// with CUDA events. One input set is 3 x 67 MB for the 16-bit grid (together 4x the 50 MB L2;
// float8: 3 x 34 MB), so repeated runs do not run from the cache. run_bench.py times torch's SDPA
// and FlashAttention-3 on the same shapes beside it. float8 inputs run as the CUDA backend serves
// them: natively when the forward variant takes float8, else (the plan refuses them) converted to
// bfloat16 copies on the device first (dequantise.h), the conversion inside the timed region, and
// the variant reported as "dequant+NAME".
//
// Built as cuda_tile_sweep (ATTENTION_TILE_SWEEP; not part of the default build) the same program
// times candidate tile shapes of the bfloat16 kernel instead, one JSON line per (shape, tile):
//   cuda_tile_sweep [D N causal]...   default: D in {64, 128} x N in {1024, 2048, 4096, 16384},
//                                     causal and not
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/cuda/check_cuda.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/forward/cuda_attention.h"
#include "kernels/cuda/forward/forward_plan.h"
#include "kernels/cuda/prep/dequantise.h"
#include "kernels/float8.h"
#include "kernels/status_macros.h"
#ifdef ATTENTION_TILE_SWEEP
#include "kernels/cuda/forward/flash_forward_launch.cuh"
#include "kernels/cuda/ops/cuda_status.h"
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

// Standard normal values (Box-Muller on a hash of the index) as float, half, bfloat16 or e4m3
// bits (rounded to nearest even; |x| < 448 always, so no NaN).
__global__ void FillNormal(void* out, int64_t n, DType dtype, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = (Hash(seed ^ (2 * i)) + 1.0f) * 2.3283064e-10f;
    const float u2 = Hash(seed ^ (2 * i + 1)) * 2.3283064e-10f;
    const float x = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    switch (dtype) {
      case DType::kFloat32:
        static_cast<float*>(out)[i] = x;
        break;
      case DType::kFloat16:
        static_cast<__half*>(out)[i] = __float2half_rn(x);
        break;
      case DType::kBFloat16:
        static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
        break;
      case DType::kFloat8E4M3:
        static_cast<uint8_t*>(out)[i] = attention::FloatToFloat8E4m3(x);
        break;
    }
  }
}

struct Shape {
  DType dtype;
  int64_t b, h, n, d;
  bool causal;
};

// The shape's JSON fields: "dtype", "d", "N", "B", "H", "causal".
std::string ShapeFields(const Shape& s) {
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "\"dtype\": \"%s\", \"d\": %lld, \"N\": %lld, \"B\": %lld, \"H\": %lld, "
                "\"causal\": %s",
                attention::DTypeName(s.dtype), (long long)s.d, (long long)s.n, (long long)s.b,
                (long long)s.h, s.causal ? "true" : "false");
  return buf;
}

using attention::cuda::ForwardVariant;

// The open-model options the bench sets (--option, the options mode).
enum class BenchOption { kNone, kSoftcap, kSinks, kChunk };
constexpr BenchOption kBenchOptions[] = {BenchOption::kSoftcap, BenchOption::kSinks,
                                         BenchOption::kChunk};
const char* BenchOptionName(BenchOption option) {
  switch (option) {
    case BenchOption::kNone:
      return "none";
    case BenchOption::kSoftcap:
      return "softcap";
    case BenchOption::kSinks:
      return "sinks";
    case BenchOption::kChunk:
      return "chunk";
  }
  return "unknown";
}

// Runs one forward pass and returns the name of what ran it (the variant's name, see TimeShape).
using Runner = std::function<absl::StatusOr<std::string>(const AttentionParams&)>;

std::string VariantName(ForwardVariant variant) {
  return std::string(attention::cuda::ForwardVariantName(variant));
}

// kCount device buffers of equal size, kept across runs and shapes (reallocated only when a shape
// needs more): the bfloat16 copies of float8 q, k, v ([B, H, N, D] each), or a launch's workspace.
template <int kCount>
class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* b : buf_) cudaFree(b);
  }
  // kCount buffers of `bytes` each.
  absl::StatusOr<std::array<void*, kCount>> Get(size_t bytes) {
    if (bytes > bytes_) {
      for (void*& b : buf_) {
        cudaFree(b);
        b = nullptr;
      }
      bytes_ = 0;
      for (void*& b : buf_) {
        if (cudaMalloc(&b, bytes) != cudaSuccess) {
          cudaGetLastError();
          return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes"));
        }
      }
      bytes_ = bytes;
    }
    return buf_;
  }

 private:
  std::array<void*, kCount> buf_ = {};
  size_t bytes_ = 0;
};

// attention::cuda::Forward, forcing `variant` when set, with the workspace its plan asks for
// (float8 on wgmma_sm90: V transposed, timed with the kernel). float8 inputs the plan refuses
// (INVALID_ARGUMENT: the variant takes no float8 for them) are served as HostRunner serves them:
// converted to bfloat16 copies first (exact), the descales left in the params for the kernel to
// fold in; the name is then "dequant+" and the variant's.
Runner ForwardRunner(std::optional<ForwardVariant> variant) {
  // The default stream's scratch: every launch here runs on it (kept for the whole process).
  static const absl::StatusOr<attention::cuda::ForwardScratch> scratch =
      attention::cuda::AllocateForwardScratch();
  auto copies = std::make_shared<DeviceBuffers<3>>();
  auto workspace = std::make_shared<DeviceBuffers<1>>();
  return [variant, copies, workspace](const AttentionParams& p) -> absl::StatusOr<std::string> {
    RETURN_IF_ERROR(scratch.status());
    absl::StatusOr<attention::cuda::ForwardLaunch> launch =
        attention::cuda::PrepareForward(p, variant);
    if (launch.ok()) {
      void* space = nullptr;
      if (launch->plan.workspace_bytes > 0) {
        ASSIGN_OR_RETURN(const auto buf, workspace->Get(launch->plan.workspace_bytes));
        space = buf[0];
      }
      RETURN_IF_ERROR(attention::cuda::LaunchForward(*launch, nullptr, *scratch, space));
      return VariantName(launch->plan.variant);
    }
    if (p.dtype != DType::kFloat8E4M3 || !absl::IsInvalidArgument(launch.status())) {
      return launch.status();
    }
    // Dense contiguous inputs (TimeShape's): q, k and v hold B * H * N * D elements each.
    const int64_t elems = p.batch * p.heads_q * p.seqlen_q * p.head_dim;
    ASSIGN_OR_RETURN(const auto buf, copies->Get(elems * attention::DTypeSize(DType::kBFloat16)));
    AttentionParams converted = p;
    converted.dtype = DType::kBFloat16;
    converted.q = buf[0];
    converted.k = buf[1];
    converted.v = buf[2];
    ASSIGN_OR_RETURN(const attention::cuda::ForwardLaunch bf16,
                     attention::cuda::PrepareForward(converted, variant));
    const void* const quantised[3] = {p.q, p.k, p.v};
    for (int t = 0; t < 3; ++t) {
      if (attention::cuda::LaunchDequantiseE4m3ToBf16(quantised[t], buf[t], elems, nullptr) !=
          cudaSuccess) {
        return absl::InternalError("dequantise float8 q, k, v");
      }
    }
    RETURN_IF_ERROR(attention::cuda::LaunchForward(bf16, nullptr, *scratch, nullptr));
    return "dequant+" + VariantName(bf16.plan.variant);
  };
}

double g_sustain_s = 0;  // --sustain_s

// Times `run` on shape s with `option` set (--option); `label` (if any) is added to the JSON line
// as "tile", `extra` as it is (more fields, each followed by ", "). Returns the median ms, or
// nothing on failure.
std::optional<double> TimeShape(const Shape& s, const Runner& run, const std::string& label = "",
                                BenchOption option = BenchOption::kNone,
                                const std::function<std::string(double)>& extra = nullptr) {
  AttentionParams p;
  p.dtype = s.dtype;
  p.batch = s.b;
  p.heads_q = p.heads_kv = s.h;
  p.seqlen_q = p.seqlen_k = s.n;
  p.head_dim = s.d;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  p.window_right = s.causal ? 0 : attention::kUnboundedWindow;
  p.SetContiguousStrides(attention::Layout::kBHSD);
  const std::vector<float> sinks(s.h, 0.5f);  // host memory, as AttentionParams has it
  switch (option) {
    case BenchOption::kNone:
      break;
    case BenchOption::kSoftcap:
      p.softcap = 50.0f;
      break;
    case BenchOption::kSinks:
      p.sinks = sinks.data();
      break;
    case BenchOption::kChunk:
      p.chunk_size = s.n;
      break;
  }
  const int64_t elems = s.b * s.h * s.n * s.d;
  const size_t bytes = elems * attention::DTypeSize(s.dtype);
  void* buf[4];
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaMalloc(&buf[i], bytes));
  CHECK_CUDA(cudaMalloc(&buf[3], elems * attention::DTypeSize(attention::OutputDType(s.dtype))));
  for (int i = 0; i < 3; ++i) FillNormal<<<1024, 256>>>(buf[i], elems, s.dtype, 1234 + i);
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
  std::string variant;
  // --sustain_s: launches back to back, checking the time every 32.
  for (const auto until =
           std::chrono::steady_clock::now() + std::chrono::duration<double>(g_sustain_s);
       ok && std::chrono::steady_clock::now() < until;) {
    for (int i = 0; i < 32 && ok; ++i) ok = run(p).ok();
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  for (int rep = 0; rep < 33 && ok; ++rep) {
    cudaEventRecord(start);
    absl::StatusOr<std::string> ran = run(p);
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
  double median = 0;
  if (ok) {
    std::sort(ms.begin(), ms.end());
    median = ms[ms.size() / 2];
    double flops = 4.0 * s.b * s.h * s.n * s.n * s.d;
    if (s.causal) flops /= 2;
    std::string fields = label.empty() ? "" : "\"tile\": \"" + label + "\", ";
    if (option != BenchOption::kNone) {
      fields += std::string("\"option\": \"") + BenchOptionName(option) + "\", ";
    }
    if (extra) fields += extra(median);
    std::printf("{%s, \"variant\": \"%s\", %s\"ms\": %.4f, \"TFLOPs\": %.1f}\n",
                ShapeFields(s).c_str(), variant.c_str(), fields.c_str(), median,
                flops / median / 1e9);
    std::fflush(stdout);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* b : buf) cudaFree(b);
  if (!ok) return std::nullopt;
  return median;
}

#ifdef ATTENTION_TILE_SWEEP
// The tiles are the mma.sync kernel's (ForwardVariant::kMmaSm80).
template <typename Tile>
Runner TileRunner() {
  return [](const AttentionParams& p) -> absl::StatusOr<std::string> {
    ASSIGN_OR_RETURN(const attention::cuda::KernelParams kp, attention::cuda::ToKernelParams(p));
    RETURN_IF_CUDA_ERROR(attention::cuda::LaunchFlashTile<Tile>(kp, nullptr), "candidate tile");
    return VariantName(ForwardVariant::kMmaSm80);
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
  BenchOption option = BenchOption::kNone;
  bool list = false;
  while (argc > 1 && std::strncmp(argv[1], "--", 2) == 0) {
    if (std::strcmp(argv[1], "--list") == 0) {
      list = true;
      argc -= 1;
      argv += 1;
    } else if (argc > 2 && std::strcmp(argv[1], "--sustain_s") == 0) {
      g_sustain_s = std::atof(argv[2]);
      argc -= 2;
      argv += 2;
    } else if (argc > 2 && std::strcmp(argv[1], "--option") == 0) {
      const auto named = std::find_if(
          std::begin(kBenchOptions), std::end(kBenchOptions),
          [&](BenchOption o) { return std::strcmp(argv[2], BenchOptionName(o)) == 0; });
      if (named == std::end(kBenchOptions)) {
        std::fprintf(stderr, "--option: expected softcap, sinks or chunk; got %s\n", argv[2]);
        return 2;
      }
      option = *named;
      argc -= 2;
      argv += 2;
    } else if (argc > 2 && std::strcmp(argv[1], "--variant") == 0) {
      const absl::StatusOr<ForwardVariant> parsed = attention::cuda::ParseForwardVariant(argv[2]);
      if (!parsed.ok()) {
        std::fprintf(stderr, "--variant: %s\n", std::string(parsed.status().message()).c_str());
        return 2;
      }
      variant = *parsed;
      argc -= 2;
      argv += 2;
    } else {
      break;
    }
  }
  const char* which = argc > 1 ? argv[1] : "grid";
  std::vector<Shape> shapes;
  if (std::strcmp(which, "fp32") == 0) {
    for (int64_t n : {1024, 4096}) shapes.push_back({DType::kFloat32, 16, 12, n, 64, false});
  } else if (std::strcmp(which, "grid") == 0 || std::strcmp(which, "options") == 0) {
    for (DType dt : {DType::kBFloat16, DType::kFloat16})
      for (int64_t d : {64, 128, 256})
        for (int64_t n : {512, 1024, 2048, 4096, 8192, 16384})
          for (bool causal : {false, true})
            shapes.push_back({dt, 16384 / n, 2048 / d, n, d, causal});
  } else if (std::strcmp(which, "fp8") == 0) {
    // FlashAttention-3's fp8 shapes: its float8 kernels cover D 64..256; 128 and 256 are the
    // head dims its fp8 numbers are quoted at.
    for (int64_t d : {128, 256})
      for (int64_t n : {1024, 4096, 16384})
        for (bool causal : {false, true})
          shapes.push_back({DType::kFloat8E4M3, 16384 / n, 2048 / d, n, d, causal});
  } else if (std::strcmp(which, "one") == 0 && argc == 6) {
    // one DTYPE D N CAUSAL: a single shape of the grid (B = 16384/N, H = 2048/D), for re-runs.
    DType dt;
    if (std::strcmp(argv[2], "float16") == 0) {
      dt = DType::kFloat16;
    } else if (std::strcmp(argv[2], "bfloat16") == 0) {
      dt = DType::kBFloat16;
    } else if (std::strcmp(argv[2], "float8_e4m3") == 0) {
      dt = DType::kFloat8E4M3;
    } else {
      std::fprintf(stderr, "one: dtype must be float16, bfloat16 or float8_e4m3; got %s\n",
                   argv[2]);
      return 2;
    }
    const int64_t d = std::atoll(argv[3]), n = std::atoll(argv[4]);
    shapes.push_back({dt, 16384 / n, 2048 / d, n, d, std::strcmp(argv[5], "true") == 0});
  } else {
    std::fprintf(stderr,
                 "usage: %s [--sustain_s S] [--variant NAME] [--option softcap|sinks|chunk] "
                 "[--list] grid|fp8|fp32|options|one {float16|bfloat16|float8_e4m3} D N "
                 "{true|false}\n",
                 program);
    return 2;
  }
  if (list) {
    for (const Shape& s : shapes) std::printf("{%s}\n", ShapeFields(s).c_str());
    return 0;
  }
  const Runner run = ForwardRunner(variant);
  const bool options = std::strcmp(which, "options") == 0;
  for (const Shape& s : shapes) {
    const std::optional<double> plain_ms =
        TimeShape(s, run, "", options ? BenchOption::kNone : option);
    if (!plain_ms) return 1;
    if (!options) continue;
    // Each option right after the plain run of the same shape and inputs: its cost as a ratio.
    for (BenchOption o : kBenchOptions) {
      auto slowdown = [&](double ms) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "\"plain_ms\": %.4f, \"slowdown\": %.4f, ", *plain_ms,
                      ms / *plain_ms);
        return std::string(buf);
      };
      if (!TimeShape(s, run, "", o, slowdown)) return 1;
    }
  }
  return 0;
}
