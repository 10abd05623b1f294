// GFLOP/s of the CPU backend against anchors measured in the same run:
//   BM_CpuBackend        our tiled online-softmax attention, float32 BHSD
//   BM_NaiveBlas         per head: S = scale Q K^T (cblas_sgemm), mask, row softmax, O = P V
//                        (cblas_sgemm); O(N^2) memory, as a first attempt would write it
//   BM_SgemmSquare       cblas_sgemm 2048^3: the ceiling any GEMM-shaped work can reach here
//   BM_CpuBackendLong    our backend at N = 65536 (B=1, H=1, D=64, causal), where the naive
//                        one would need a 16 GiB score matrix per head
//   BM_CpuBackendService the two shapes of the service-overhead cases (bench/README.md), with all
//                        threads and with one: many tiny heads (float32 B=512|2048 H=16 N=8 D=64,
//                        64|256 MiB moved per call) and a small request (float16 B=1 H=8 N=128
//                        D=64)
//   BM_StreamQkvToO      anchor for the tiny heads: o = q + k + v over the same tensors, the memory
//                        traffic any attention pass must make (GB/s counts q, k, v and o)
// Attention FLOPs = 4 B H Nq Nk D, halved when causal; sgemm FLOPs = 2 M N K.
// bench/cpu/ratios.py turns the JSON output into ratios (see bench/README.md).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/dtype_convert.h"

namespace attention {
namespace {

struct Problem {
  int64_t batch, heads, seqlen, head_dim;
  bool causal;
  DType dtype = DType::kFloat32;
};

int64_t Elements(const Problem& s) { return s.batch * s.heads * s.seqlen * s.head_dim; }

double AttentionFlops(const Problem& s) {
  const double full = 4.0 * s.batch * s.heads * s.seqlen * s.seqlen * s.head_dim;
  return s.causal ? full / 2 : full;
}

std::vector<float> RandomNormal(int64_t n) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// RandomNormal(n) stored as `dtype`.
std::vector<unsigned char> RandomTensor(int64_t n, DType dtype) {
  const std::vector<float> x = RandomNormal(n);
  std::vector<unsigned char> out(n * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(out.data(), i, dtype, x[i]);
  return out;
}

void SetRate(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iteration / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// q, k, v read and o written once per iteration.
void SetTraffic(benchmark::State& state, const Problem& s) {
  state.counters["GB/s"] = benchmark::Counter(4.0 * Elements(s) * DTypeSize(s.dtype) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// threads = 0: all the CPUs this process may use (one backend per thread count, kept).
void RunCpuBackend(benchmark::State& state, const Problem& s, int threads = 0) {
  const int64_t elements = Elements(s);
  const std::vector<unsigned char> q = RandomTensor(elements, s.dtype),
                                   k = RandomTensor(elements, s.dtype),
                                   v = RandomTensor(elements, s.dtype);
  std::vector<unsigned char> o(elements * DTypeSize(s.dtype));
  AttentionParams p;
  p.dtype = s.dtype;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o.data();
  p.batch = s.batch;
  p.heads_q = p.heads_kv = s.heads;
  p.seqlen_q = p.seqlen_k = s.seqlen;
  p.head_dim = s.head_dim;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  if (s.causal) p.window_right = 0;
  p.SetContiguousStrides(Layout::kBHSD);
  static std::map<int, cpu::CpuBackend*>* backends = new std::map<int, cpu::CpuBackend*>();
  cpu::CpuBackend*& backend = (*backends)[threads];
  if (backend == nullptr) backend = new cpu::CpuBackend({.threads = threads});
  for (auto _ : state) {
    if (absl::Status status = backend->Forward(p); !status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["threads"] = backend->threads();
  SetRate(state, AttentionFlops(s));
  SetTraffic(state, s);
}

// q, k, v, o: [H, N, D] (B = 1); s: [N, N] reused per head.
void RunNaiveBlas(benchmark::State& state, const Problem& s) {
  const int n = static_cast<int>(s.seqlen), d = static_cast<int>(s.head_dim);
  const int64_t elements = s.heads * s.seqlen * s.head_dim;
  const std::vector<float> q = RandomNormal(elements), k = RandomNormal(elements),
                           v = RandomNormal(elements);
  std::vector<float> o(elements), scores(static_cast<size_t>(n) * n);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (auto _ : state) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t at = h * n * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, d, scale, q.data() + at, d,
                  k.data() + at, d, 0.0f, scores.data(), n);
      for (int i = 0; i < n; ++i) {
        float* row = scores.data() + static_cast<size_t>(i) * n;
        if (s.causal) std::fill(row + i + 1, row + n, -std::numeric_limits<float>::infinity());
        const float max = *std::max_element(row, row + n);
        float sum = 0;
        for (int j = 0; j < n; ++j) sum += row[j] = std::exp(row[j] - max);
        const float inv = 1.0f / sum;
        for (int j = 0; j < n; ++j) row[j] *= inv;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, n, 1.0f, scores.data(), n,
                  v.data() + at, d, 0.0f, o.data() + at, d);
    }
    benchmark::DoNotOptimize(o.data());
  }
  SetRate(state, AttentionFlops(s));
}

constexpr Problem kStandard = {1, 8, 2048, 64, false};
constexpr Problem kStandardCausal = {1, 8, 2048, 64, true};
constexpr Problem kLongCausal = {1, 1, 65536, 64, true};
// The service-overhead cases (bench/echo/run_overhead.sh).
constexpr Problem kTinyHeads16MiB = {512, 16, 8, 64, false};
constexpr Problem kTinyHeads64MiB = {2048, 16, 8, 64, false};
constexpr Problem kSmallHalf = {1, 8, 128, 64, false, DType::kFloat16};
constexpr Problem kServiceCases[] = {kTinyHeads16MiB, kTinyHeads64MiB, kSmallHalf};

void BM_CpuBackend(benchmark::State& state) {
  RunCpuBackend(state, state.range(0) ? kStandardCausal : kStandard);
}
void BM_NaiveBlas(benchmark::State& state) {
  RunNaiveBlas(state, state.range(0) ? kStandardCausal : kStandard);
}
void BM_CpuBackendLong(benchmark::State& state) { RunCpuBackend(state, kLongCausal); }
void BM_CpuBackendService(benchmark::State& state) {
  RunCpuBackend(state, kServiceCases[state.range(0)], static_cast<int>(state.range(1)));
}

// o = q + k + v, float32, over a tiny-heads case's tensors: one pass over the same bytes.
void BM_StreamQkvToO(benchmark::State& state) {
  const Problem& s = kServiceCases[state.range(0)];
  const int64_t n = Elements(s);
  const std::vector<float> q = RandomNormal(n), k = RandomNormal(n), v = RandomNormal(n);
  std::vector<float> o(n);
  for (auto _ : state) {
    for (int64_t i = 0; i < n; ++i) o[i] = q[i] + k[i] + v[i];
    benchmark::DoNotOptimize(o.data());
  }
  SetTraffic(state, s);
}

void BM_SgemmSquare(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::vector<float> a = RandomNormal(static_cast<int64_t>(n) * n),
                           b = RandomNormal(static_cast<int64_t>(n) * n);
  std::vector<float> c(static_cast<size_t>(n) * n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  SetRate(state, 2.0 * n * n * n);
}

BENCHMARK(BM_SgemmSquare)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_NaiveBlas)
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuBackend)
    ->ArgName("causal")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuBackendLong)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
// case: 0 = tiny heads 16 MiB, 1 = tiny heads 64 MiB, 2 = small float16; threads 0 = all.
BENCHMARK(BM_CpuBackendService)
    ->ArgNames({"case", "threads"})
    ->ArgsProduct({{0, 1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_StreamQkvToO)
    ->ArgName("case")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
}  // namespace attention

BENCHMARK_MAIN();
