// GFLOP/s of the CPU backend against anchors measured in the same run:
//   BM_CpuBackend        our tiled online-softmax attention, float32 BHSD
//   BM_NaiveBlas         per head: S = scale Q K^T (cblas_sgemm), mask, row softmax, O = P V
//                        (cblas_sgemm); O(N^2) memory, as a first attempt would write it
//   BM_SgemmSquare       cblas_sgemm 2048^3: the ceiling any GEMM-shaped work can reach here
//   BM_CpuBackendLong    our backend at N = 65536 (B=1, H=1, D=64, causal), where the naive
//                        one would need a 16 GiB score matrix per head
// Attention FLOPs = 4 B H Nq Nk D, halved when causal; sgemm FLOPs = 2 M N K.
// bench/cpu/ratios.py turns the JSON output into ratios (see bench/README.md).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_attention.h"

namespace attention {
namespace {

struct Problem {
  int64_t batch, heads, seqlen, head_dim;
  bool causal;
};

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

void SetRate(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iteration / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void RunCpuBackend(benchmark::State& state, const Problem& s) {
  const int64_t elements = s.batch * s.heads * s.seqlen * s.head_dim;
  const std::vector<float> q = RandomNormal(elements), k = RandomNormal(elements),
                           v = RandomNormal(elements);
  std::vector<float> o(elements);
  AttentionParams p;
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
  static cpu::CpuBackend* backend = new cpu::CpuBackend();
  for (auto _ : state) {
    if (absl::Status status = backend->Forward(p); !status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["threads"] = backend->threads();
  SetRate(state, AttentionFlops(s));
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

void BM_CpuBackend(benchmark::State& state) {
  RunCpuBackend(state, state.range(0) ? kStandardCausal : kStandard);
}
void BM_NaiveBlas(benchmark::State& state) {
  RunNaiveBlas(state, state.range(0) ? kStandardCausal : kStandard);
}
void BM_CpuBackendLong(benchmark::State& state) { RunCpuBackend(state, kLongCausal); }

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

}  // namespace
}  // namespace attention

BENCHMARK_MAIN();
