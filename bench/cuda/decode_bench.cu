// Times one decode step over the paged KV cache (kernels/cuda/paged_decode.h: one launch of the
// split-KV kernel, whose last split per row block merges the splits; no host copies) and prints
// one JSON line per configuration:
//   decode_bench [NK...]   default NK in {4096, 32768, 131072}
// Shape: bfloat16, B = 8 sequences of NK keys, Hq = 32, Hkv = 8, D = 128, one query each. Pages
// of 256 KiB, 512 KiB and 1 MiB (64, 128, 256 rows) with the planner's splits, and 256 KiB pages
// with forced split counts. Each sequence's pages are a random permutation of the pool. Each
// configuration: 5 warm-up steps, then the median of 50 steps timed with CUDA events, each after
// a 256 MiB memset that evicts the 50 MB L2 (as triton's do_bench does). "kv_tbps" = bytes of K
// and V read (B * NK * Hkv * D * 2 * 2) / time. decode_bench.py runs torch SDPA beside it.
//
// Built as decode_tile_sweep (ATTENTION_PAGED_TILE_SWEEP; not part of the default build, sm_90a
// only) it times candidate tiles (key tile x stages x warps) of the bfloat16 D=128 kernel instead,
// 256 KiB pages, each with the planner's splits for its occupancy: one JSON line per (NK, tile).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda/check_cuda.h"
#include "kernels/cuda/paged_decode.h"
#include "kernels/paged_kv.h"
#include "kernels/paged_kv_host.h"
#ifdef ATTENTION_PAGED_TILE_SWEEP
#include "kernels/cuda/paged_decode_launch.cuh"
#endif

namespace {

using attention::DType;

constexpr int64_t kBatch = 8, kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;

// Uniform values in [-2, 2) from a hash of the index (the inputs' distribution does not change
// what a memory-bound kernel reads).
__global__ void FillRandom(__nv_bfloat16* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (seed + i) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    out[i] = __float2bfloat16_rn(static_cast<float>(x >> 40) * (4.0f / 16777216.0f) - 2.0f);
  }
}

// A kernel other than the default one (the tile sweep).
struct Variant {
  std::string name;
  int key_tile = 0;
  int ctas_per_sm = 0;
  cudaError_t (*launch)(const attention::cuda::PagedKernelParams&, dim3, cudaStream_t) = nullptr;
};

struct Config {
  int64_t nk;
  int64_t page_bytes;
  int splits;  // 0: the planner's
  const Variant* variant = nullptr;
};

bool TimeConfig(const Config& c, int sm_count, void* flush, size_t flush_bytes) {
  const int64_t page_rows = attention::PageRows(c.page_bytes, DType::kBFloat16, kHeadsKv, kHeadDim);
  const int64_t pages_per_seq = (c.nk + page_rows - 1) / page_rows;
  const int64_t num_pages = kBatch * pages_per_seq;
  std::vector<int32_t> table(num_pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(42));
  std::vector<int32_t> cu_q(kBatch + 1), seqlens(kBatch, static_cast<int32_t>(c.nk));
  std::iota(cu_q.begin(), cu_q.end(), 0);

  attention::PagedDecodeParams host;
  host.shape = {DType::kBFloat16, kHeadsKv, kHeadDim};
  host.heads_q = kHeadsQ;
  host.num_seqs = kBatch;
  host.cu_seqlens_q = cu_q.data();
  host.total_q = kBatch;
  host.max_seqlen_q = 1;
  host.seqlens_k = seqlens.data();
  host.max_seqlen_k = c.nk;
  host.page_table = table.data();
  host.page_table_stride = pages_per_seq;
  host.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<uint16_t> dummy(kBatch * kHeadsQ * kHeadDim);
  host.q = dummy.data();
  host.o = dummy.data();
  const absl::StatusOr<attention::DecodeExtent> extent =
      attention::CheckPagedDecode(host, c.page_bytes, num_pages);
  if (!extent.ok()) {
    std::fprintf(stderr, "%s\n", std::string(extent.status().message()).c_str());
    return false;
  }
  const absl::StatusOr<attention::cuda::PagedDecodePlan> plan =
      attention::cuda::PlanPagedDecode(host, *extent,
                                       {.sm_count = sm_count,
                                        .splits = c.splits,
                                        .ctas_per_sm = c.variant ? c.variant->ctas_per_sm : 0,
                                        .key_tile = c.variant ? c.variant->key_tile : 0});
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
    return false;
  }

  const size_t pool_bytes = static_cast<size_t>(num_pages) * c.page_bytes;
  const size_t q_elems = kBatch * kHeadsQ * kHeadDim;
  void *pool, *q, *o, *lse, *meta, *workspace = nullptr, *tickets = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, pool_bytes));
  CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&o, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&lse, kBatch * kHeadsQ * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&meta, (table.size() + cu_q.size() + seqlens.size()) * sizeof(int32_t)));
  if (plan->workspace_bytes) CHECK_CUDA(cudaMalloc(&workspace, plan->workspace_bytes));
  if (plan->tickets) {
    // Zeroed once: every step leaves its tickets zero.
    CHECK_CUDA(cudaMalloc(&tickets, plan->tickets * sizeof(int32_t)));
    CHECK_CUDA(cudaMemset(tickets, 0, plan->tickets * sizeof(int32_t)));
  }
  FillRandom<<<4096, 256>>>(static_cast<__nv_bfloat16*>(pool), pool_bytes / 2, 1);
  FillRandom<<<64, 256>>>(static_cast<__nv_bfloat16*>(q), q_elems, 2);
  auto* m = static_cast<int32_t*>(meta);
  CHECK_CUDA(cudaMemcpy(m, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m + table.size(), cu_q.data(), cu_q.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m + table.size() + cu_q.size(), seqlens.data(), seqlens.size() * 4,
                        cudaMemcpyHostToDevice));
  attention::PagedDecodeParams dev = host;
  dev.q = q;
  dev.o = o;
  dev.lse = static_cast<float*>(lse);
  dev.page_table = m;
  dev.cu_seqlens_q = m + table.size();
  dev.seqlens_k = m + table.size() + cu_q.size();

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int rep = 0; rep < 55; ++rep) {
    CHECK_CUDA(cudaMemsetAsync(flush, rep, flush_bytes));
    CHECK_CUDA(cudaEventRecord(start));
    const absl::Status st =
        c.variant != nullptr
            ? absl::OkStatus()
            : attention::cuda::LaunchPagedDecode(*plan, pool, c.page_bytes, *extent, dev, workspace,
                                                 static_cast<int32_t*>(tickets), 0);
#ifdef ATTENTION_PAGED_TILE_SWEEP
    if (c.variant != nullptr) {
      const attention::cuda::PagedKernelParams kp = attention::cuda::ToPagedKernelParams(
          *plan, pool, c.page_bytes, *extent, dev, workspace, static_cast<int32_t*>(tickets));
      CHECK_CUDA(c.variant->launch(
          kp, dim3(kp.splits, kp.heads_kv * kp.m_blocks, plan->launch.num_seqs), 0));
    }
#endif
    CHECK_CUDA(cudaEventRecord(stop));
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return false;
    }
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (rep >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double us = ms[ms.size() / 2] * 1e3;
  const double kv_bytes = 2.0 * kBatch * c.nk * kHeadsKv * kHeadDim * 2;
  std::printf(
      "{%s\"nk\": %lld, \"page_bytes\": %lld, \"page_rows\": %lld, \"splits\": %d, "
      "\"forced_splits\": %s, \"ctas\": %lld, \"us\": %.2f, \"kv_tbps\": %.3f}\n",
      c.variant ? ("\"tile\": \"" + c.variant->name + "\", ").c_str() : "", (long long)c.nk,
      (long long)c.page_bytes, (long long)page_rows, plan->splits, c.splits ? "true" : "false",
      (long long)plan->splits * kHeadsKv * plan->m_blocks * kBatch, us, kv_bytes / us / 1e6);
  std::fflush(stdout);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* p : {pool, q, o, lse, meta, workspace, tickets}) cudaFree(p);
  return true;
}

#ifdef ATTENTION_PAGED_TILE_SWEEP
template <typename Tile>
Variant MakeVariant() {
  Variant v;
  v.name = std::to_string(Tile::kBc) + "keys_x" + std::to_string(Tile::kStages) + "stages_" +
           std::to_string(Tile::kWarps) + "warps";
  v.key_tile = Tile::kBc;
  v.launch = attention::cuda::LaunchPagedTile<Tile>;
  auto* kernel = attention::cuda::PagedDecodeKernel<Tile>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.ctas_per_sm, kernel, Tile::kThreads,
                                                Tile::kSmemBytes);
  return v;
}

std::vector<Variant> Variants() {
  using attention::cuda::PagedTile;
  using T = __nv_bfloat16;
  return {MakeVariant<PagedTile<T, 128, 64, 4, 4>>(), MakeVariant<PagedTile<T, 128, 64, 3, 4>>(),
          MakeVariant<PagedTile<T, 128, 64, 5, 4>>(), MakeVariant<PagedTile<T, 128, 64, 6, 4>>(),
          MakeVariant<PagedTile<T, 128, 64, 2, 4>>()};
}
#endif

bool Main(const std::vector<int64_t>& nks) {
  int sm_count = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  const size_t flush_bytes = size_t{256} << 20;
  void* flush;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
#ifdef ATTENTION_PAGED_TILE_SWEEP
  const std::vector<Variant> variants = Variants();
#endif
  for (int64_t nk : nks) {
    std::vector<Config> configs;
#ifdef ATTENTION_PAGED_TILE_SWEEP
    for (const Variant& v : variants) configs.push_back({nk, 256 << 10, 0, &v});
#else
    for (int64_t page_bytes : {256 << 10, 512 << 10, 1 << 20})
      configs.push_back({nk, page_bytes, 0});
    for (int splits : {4, 8, 16, 32, 64}) configs.push_back({nk, 256 << 10, splits});
#endif
    for (const Config& c : configs) {
      if (!TimeConfig(c, sm_count, flush, flush_bytes)) return false;
    }
  }
  cudaFree(flush);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> nks;
  for (int i = 1; i < argc; ++i) nks.push_back(std::atoll(argv[i]));
  if (nks.empty()) nks = {4096, 32768, 131072};
  return Main(nks) ? 0 : 1;
}
