// Times one decode step over the paged KV cache (kernels/cuda/decode/paged_decode.h: one launch of
// the split-KV kernel, whose last split per row block merges the splits; no host copies) and prints
// one JSON line per configuration:
//   decode_bench [NK...]   default NK in {4096, 32768, 131072}
//   decode_bench --shapes [NK...]   default NK in {4096, 32768}: the shapes below instead
// Shape: bfloat16, B = 8 sequences of NK keys, Hq = 32, Hkv = 8, D = 128, one query each. Pages
// of 256 KiB, 512 KiB and 1 MiB (64, 128, 256 rows) with the planner's splits, and 256 KiB pages
// with forced split counts. Each sequence's pages are a random permutation of the pool. Each
// configuration: 5 warm-up steps, then the median of 50 steps timed with CUDA events, each after
// a 256 MiB memset that evicts the 50 MB L2 (as triton's do_bench does; "flush": "memset"). That
// memset leaves the L2 full of dirty lines, written back to DRAM while the timed step reads; the
// planned configurations are also timed after the memset and a read of the same 256 MiB, which
// leaves clean lines only ("flush": "clean"). "kv_tbps" = bytes of K and V read
// (B * NK * Hkv * D * 2 * 2) / time. decode_bench.py runs torch SDPA beside it.
//
// --shapes: the head dims beyond the tensor-core tiles, bfloat16, one query per sequence, B in
// {1, 8, 32, 64}, 512 KiB pages, the planner's splits, the memset flush: MLA's absorbed decode (one
// KV head, QK 576, V 512) with Hq 128 and 16 ("mla_hq128", "mla_hq16"), and D = 512 with V of D
// (Hq 32, Hkv 4: "d512_gqa8"). The pool holds V apart from K (a session's v as sent), so the step
// reads B * NK * Hkv * (D + Dv) * 2 bytes: "kv_tbps" is that over the time; "latent_tbps" counts
// K's bytes alone (B * NK * Hkv * D * 2), the traffic of a kernel that takes V from the first Dv
// columns of K (FlashMLA's; V counted once), for comparison with the HBM roofline and FlashMLA's
// figures. "mla_latent_hq128" and "mla_latent_hq16" are MLA's shapes with V in K's rows (a session
// created with v_from_k: K alone stored and read, kv_tbps = latent_tbps). "kernel": "wide" (the
// wide tensor-core tile, where the GPU's blocks may opt in to its shared memory) or "simt".
//
// The roofline anchor ("anchor" lines, both flushes): a read-only kernel over the same pool (at
// Hkv = 8 the pool is exactly the step's K/V bytes), 16-byte loads, 8 in flight per thread,
// XOR-reduced so no load is dead: each CTA a contiguous slice in address order ("linear") or in
// the step's page-table order ("paged"), or the whole grid sweeping the pool in address order
// ("stride": consecutive CTAs read consecutive 64 KiB blocks); with or without the L2 evict_first
// policy; on 128 CTAs (the step's grid) and 1, 2 and 4 per SM; and an empty kernel (the launch).
//
// Built as decode_tile_sweep (ATTENTION_PAGED_TILE_SWEEP; not part of the default build, sm_90a
// only) it times candidate tiles (key tile x stages x warps) of the bfloat16 D=128 kernel instead,
// 256 KiB pages, each with the planner's splits for its occupancy: one JSON line per (NK, variant,
// flush). Its "trace" variant also records %globaltimer in every CTA at the kernel's trace points
// (PagedTracePoint) over one more step and prints each point's min / median / max across CTAs, in
// us from the first CTA's start.
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
#include "kernels/cuda/decode/paged_decode.h"
#include "kernels/paged_kv.h"
#include "kernels/paged_kv_host.h"
#ifdef ATTENTION_PAGED_TILE_SWEEP
#include "kernels/cuda/decode/paged_decode_launch.cuh"
#endif

namespace {

using attention::DType;

// A step's shape: B sequences of one query each, Hq query heads over Hkv kv heads, head dims D
// (q, k) and Dv (v, o). The default is the grid's; --shapes times the named ones.
struct Shape {
  const char* name = nullptr;  // printed when set
  int64_t batch = 8, heads_q = 32, heads_kv = 8, head_dim = 128, v_head_dim = 128;
  bool v_from_k = false;  // V is K's first Dv columns, kept once
};

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

constexpr int kAnchorThreads = 512, kAnchorUnroll = 8;

__device__ __forceinline__ uint4 LoadStreaming(const uint4* p, bool evict_first, uint64_t policy) {
  uint4 x;
  if (evict_first) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "l"(p), "l"(policy));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "l"(p));
  }
  return x;
}

enum class Order { kLinear, kPaged, kStride };

// Reads n16 16-byte vectors of src: with kLinear / kPaged, CTA b the slice
// [b, b + 1) * n16 / gridDim.x, vector i at i (linear) or in page table[i >> page_shift] (paged:
// 2^page_shift vectors per page); with kStride, block k of kAnchorUnroll * kAnchorThreads vectors
// by CTA k % gridDim.x. The XOR of all words is stored only when it equals a constant, so no load
// is dead.
template <bool kEvictFirst, Order kOrder>
__global__ void __launch_bounds__(kAnchorThreads)
    ReadAnchor(const uint4* src, int64_t n16, const int32_t* table, int page_shift,
               uint32_t* sink) {
  constexpr int64_t kBlock = kAnchorUnroll * kAnchorThreads;
  const int64_t per_cta = (n16 + gridDim.x - 1) / gridDim.x;
  const int64_t lo = kOrder == Order::kStride ? blockIdx.x * kBlock : blockIdx.x * per_cta;
  const int64_t hi = kOrder == Order::kStride ? n16 : min(n16, lo + per_cta);
  const int64_t step = kOrder == Order::kStride ? gridDim.x * kBlock : kBlock;
  uint64_t policy = 0;
  if (kEvictFirst)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  const int64_t mask = (int64_t{1} << page_shift) - 1;
  uint32_t acc = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += step) {
    uint4 x[kAnchorUnroll];
#pragma unroll
    for (int j = 0; j < kAnchorUnroll; ++j) {
      const int64_t idx = i + j * kAnchorThreads;
      x[j] = make_uint4(0, 0, 0, 0);
      if (idx < hi) {
        const int64_t at =
            kOrder == Order::kPaged
                ? (static_cast<int64_t>(table[idx >> page_shift]) << page_shift) + (idx & mask)
                : idx;
        x[j] = LoadStreaming(src + at, kEvictFirst, policy);
      }
    }
#pragma unroll
    for (int j = 0; j < kAnchorUnroll; ++j) acc ^= x[j].x ^ x[j].y ^ x[j].z ^ x[j].w;
  }
  if (acc == 0x2545f491u) *sink = acc;
}

__global__ void EmptyKernel() {}

// The L2 eviction before each timed run (see the top of the file).
struct Flush {
  void* buffer = nullptr;
  size_t bytes = size_t{256} << 20;
  uint32_t* sink = nullptr;
};

// Median microseconds of 50 runs of `run` after 5 warm-ups, each after evicting the L2.
template <typename Run>
bool MedianUs(const Flush& flush, bool clean, Run run, double* us) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int rep = 0; rep < 55; ++rep) {
    CHECK_CUDA(cudaMemsetAsync(flush.buffer, rep, flush.bytes));
    if (clean) {
      ReadAnchor<false, Order::kStride><<<528, kAnchorThreads>>>(
          static_cast<const uint4*>(flush.buffer), flush.bytes / 16, nullptr, 0, flush.sink);
    }
    CHECK_CUDA(cudaEventRecord(start));
    if (!run()) return false;
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (rep >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  *us = ms[ms.size() / 2] * 1e3;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return true;
}

const char* FlushName(bool clean) { return clean ? "clean" : "memset"; }

// The anchors over `pool` (pool_bytes, pages of page_bytes in the order of `table`, a device
// copy): one JSON line each per flush.
bool TimeAnchors(int64_t nk, const void* pool, size_t pool_bytes, int64_t page_bytes,
                 const int32_t* table, int sm_count, const Flush& flush) {
  using Kernel = void (*)(const uint4*, int64_t, const int32_t*, int, uint32_t*);
  struct Anchor {
    const char* name;
    Kernel kernel;
  };
  const Anchor anchors[] = {{"linear", ReadAnchor<false, Order::kLinear>},
                            {"linear_evict_first", ReadAnchor<true, Order::kLinear>},
                            {"paged", ReadAnchor<false, Order::kPaged>},
                            {"paged_evict_first", ReadAnchor<true, Order::kPaged>},
                            {"stride", ReadAnchor<false, Order::kStride>},
                            {"stride_evict_first", ReadAnchor<true, Order::kStride>}};
  const int page_shift = static_cast<int>(std::log2(static_cast<double>(page_bytes / 16)));
  const double kv_bytes = static_cast<double>(pool_bytes);
  for (bool clean : {false, true}) {
    double us = 0;
    if (!MedianUs(
            flush, clean,
            [&] {
              EmptyKernel<<<sm_count, kAnchorThreads>>>();
              return cudaGetLastError() == cudaSuccess;
            },
            &us)) {
      return false;
    }
    std::printf(
        "{\"anchor\": \"empty\", \"nk\": %lld, \"flush\": \"%s\", \"ctas\": %d, "
        "\"us\": %.2f}\n",
        (long long)nk, FlushName(clean), sm_count, us);
    for (const Anchor& a : anchors) {
      for (int ctas : {128, sm_count, 2 * sm_count, 4 * sm_count}) {
        if (!MedianUs(
                flush, clean,
                [&] {
                  a.kernel<<<ctas, kAnchorThreads>>>(static_cast<const uint4*>(pool),
                                                     pool_bytes / 16, table, page_shift,
                                                     flush.sink);
                  return cudaGetLastError() == cudaSuccess;
                },
                &us)) {
          return false;
        }
        std::printf(
            "{\"anchor\": \"%s\", \"nk\": %lld, \"page_bytes\": %lld, \"flush\": \"%s\", "
            "\"ctas\": %d, \"us\": %.2f, \"kv_tbps\": %.3f}\n",
            a.name, (long long)nk, (long long)page_bytes, FlushName(clean), ctas, us,
            kv_bytes / us / 1e6);
      }
    }
  }
  std::fflush(stdout);
  return true;
}

// A kernel other than the default one (the tile sweep).
struct Variant {
  std::string name;
  int key_tile = 0;
  int ctas_per_sm = 0;
  cudaError_t (*launch)(const attention::cuda::PagedKernelParams&, dim3, cudaStream_t) = nullptr;
  bool trace = false;    // print the trace points of one more step (PrintTrace)
  bool clusters = true;  // as Config::clusters
};

struct Config {
  int64_t nk;
  int64_t page_bytes;
  int splits;  // 0: the planner's
  const Variant* variant = nullptr;
  bool anchors = false;  // also time the roofline anchors over this configuration's pool
  // Splits merge in thread-block clusters where the GPU runs the cluster merge (else through the
  // global workspace and tickets).
  bool clusters = true;
  Shape shape = {};
};

struct Device {
  int sm_count = 0;
  // Compute capability 9.0: the kernels' sm_90a code runs, with the cluster merge
  // (paged_kv_pool.cc).
  bool clusters = false;
  int smem_per_block = 0;  // shared memory a block may opt in to (the wide tile's room)
};

#ifdef ATTENTION_PAGED_TILE_SWEEP
// %globaltimer (ns) per CTA (x + gridDim.x * (y + gridDim.y * z)) and trace point.
constexpr int kTraceMaxCtas = 4096, kTracePoints = 5;
__device__ uint64_t g_trace[kTraceMaxCtas][kTracePoints];
struct GlobalTimerTrace {
  __device__ static void Mark(attention::cuda::PagedTracePoint point) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta < kTraceMaxCtas) g_trace[cta][point] = t;
  }
};

// One more step of `step` after a memset flush with g_trace zeroed: per trace point, the min /
// median / max over the grid's CTAs in us from the earliest start, as one JSON line.
template <typename Step>
bool PrintTrace(const Config& c, int64_t ctas, const Flush& flush, Step step) {
  static const char* kNames[kTracePoints] = {"start", "first_tile", "loop_done", "stored", "end"};
  std::vector<uint64_t> t(kTraceMaxCtas * kTracePoints, 0);
  CHECK_CUDA(cudaMemcpyToSymbol(g_trace, t.data(), t.size() * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemsetAsync(flush.buffer, 1, flush.bytes));
  if (!step()) return false;
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpyFromSymbol(t.data(), g_trace, t.size() * sizeof(uint64_t)));
  const int64_t n = std::min<int64_t>(ctas, kTraceMaxCtas);
  uint64_t t0 = ~uint64_t{0};
  for (int64_t i = 0; i < n; ++i) t0 = std::min(t0, t[i * kTracePoints]);
  std::string line = "{\"trace\": \"" + c.variant->name + "\", \"nk\": " + std::to_string(c.nk);
  for (int point = 0; point < kTracePoints; ++point) {
    std::vector<double> us;
    for (int64_t i = 0; i < n; ++i) us.push_back((t[i * kTracePoints + point] - t0) * 1e-3);
    std::sort(us.begin(), us.end());
    char buf[128];
    std::snprintf(buf, sizeof(buf), ", \"%s\": [%.2f, %.2f, %.2f]", kNames[point], us.front(),
                  us[us.size() / 2], us.back());
    line += buf;
  }
  std::printf("%s}\n", line.c_str());
  std::fflush(stdout);
  return true;
}
#endif

bool TimeConfig(const Config& c, const Device& device, const Flush& flush) {
  const int sm_count = device.sm_count;
  const Shape& sh = c.shape;
  const attention::KvShape kv_shape{DType::kBFloat16, sh.heads_kv, sh.head_dim, sh.v_head_dim,
                                    sh.v_from_k};
  const int64_t page_rows = attention::PageRows(c.page_bytes, kv_shape);
  const int64_t pages_per_seq = (c.nk + page_rows - 1) / page_rows;
  const int64_t num_pages = sh.batch * pages_per_seq;
  std::vector<int32_t> table(num_pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(42));
  std::vector<int32_t> cu_q(sh.batch + 1), seqlens(sh.batch, static_cast<int32_t>(c.nk));
  std::iota(cu_q.begin(), cu_q.end(), 0);

  attention::PagedDecodeParams host;
  host.shape = kv_shape;
  host.heads_q = sh.heads_q;
  host.num_seqs = sh.batch;
  host.cu_seqlens_q = cu_q.data();
  host.total_q = sh.batch;
  host.max_seqlen_q = 1;
  host.seqlens_k = seqlens.data();
  host.max_seqlen_k = c.nk;
  host.page_table = table.data();
  host.page_table_stride = pages_per_seq;
  host.softmax_scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  std::vector<uint16_t> dummy(sh.batch * sh.heads_q * std::max(sh.head_dim, sh.v_head_dim));
  host.q = dummy.data();
  host.o = dummy.data();
  const absl::StatusOr<attention::DecodeExtent> extent =
      attention::CheckPagedDecode(host, c.page_bytes, num_pages);
  if (!extent.ok()) {
    std::fprintf(stderr, "%s\n", std::string(extent.status().message()).c_str());
    return false;
  }
  const absl::StatusOr<attention::cuda::PagedDecodePlan> plan = attention::cuda::PlanPagedDecode(
      host, *extent,
      {.sm_count = sm_count,
       .splits = c.splits,
       .ctas_per_sm = c.variant ? c.variant->ctas_per_sm : 0,
       .key_tile = c.variant ? c.variant->key_tile : 0,
       .clusters = device.clusters && c.clusters && (!c.variant || c.variant->clusters),
       .smem_per_block = device.smem_per_block});
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
    return false;
  }

  const size_t pool_bytes = static_cast<size_t>(num_pages) * c.page_bytes;
  const size_t q_elems = sh.batch * sh.heads_q * sh.head_dim;
  const size_t o_elems = sh.batch * sh.heads_q * sh.v_head_dim;
  void *pool, *q, *o, *lse, *meta, *workspace = nullptr, *tickets = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, pool_bytes));
  CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&o, o_elems * 2));
  CHECK_CUDA(cudaMalloc(&lse, sh.batch * sh.heads_q * sizeof(float)));
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

  auto step = [&] {
    if (c.variant == nullptr) {
      const absl::Status st = attention::cuda::LaunchPagedDecode(
          *plan, pool, c.page_bytes, *extent, dev, workspace, static_cast<int32_t*>(tickets), 0);
      if (!st.ok()) std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return st.ok();
    }
#ifdef ATTENTION_PAGED_TILE_SWEEP
    const attention::cuda::PagedKernelParams kp = attention::cuda::ToPagedKernelParams(
        *plan, pool, c.page_bytes, *extent, dev, workspace, static_cast<int32_t*>(tickets));
    const cudaError_t err =
        c.variant->launch(kp, dim3(kp.splits, kp.heads_kv * kp.m_blocks, plan->launch.num_seqs), 0);
    if (err != cudaSuccess) std::fprintf(stderr, "%s\n", cudaGetErrorString(err));
    return err == cudaSuccess;
#else
    return false;
#endif
  };
  // K's bytes, and V's after them (apart from K unless the shape keeps V in K's rows).
  const double k_bytes = 2.0 * sh.batch * c.nk * sh.heads_kv * sh.head_dim;
  const double kv_bytes =
      k_bytes + (sh.v_from_k ? 0.0 : 2.0 * sh.batch * c.nk * sh.heads_kv * sh.v_head_dim);
  const int64_t ctas = int64_t{plan->splits} * sh.heads_kv * plan->m_blocks * sh.batch;
  // Forced split counts only after the memset (the planner's rows after both flushes; a named
  // shape's after the memset only).
  for (bool clean : {false, true}) {
    if (clean && (c.splits != 0 || sh.name != nullptr)) break;
    double us = 0;
    if (!MedianUs(flush, clean, step, &us)) return false;
    std::string named;
    if (sh.name != nullptr) {
      char buf[256];
      std::snprintf(buf, sizeof(buf),
                    "\"shape\": \"%s\", \"batch\": %lld, \"hq\": %lld, \"hkv\": %lld, "
                    "\"d\": %lld, \"dv\": %lld, \"kernel\": \"%s\", \"latent_tbps\": %.3f, ",
                    sh.name, (long long)sh.batch, (long long)sh.heads_q, (long long)sh.heads_kv,
                    (long long)sh.head_dim, (long long)sh.v_head_dim,
                    plan->launch.wide_head_dim != 0 ? "wide" : "simt", k_bytes / us / 1e6);
      named = buf;
    }
    std::printf(
        "{%s%s\"nk\": %lld, \"page_bytes\": %lld, \"page_rows\": %lld, \"splits\": %d, "
        "\"forced_splits\": %s, \"cluster\": %s, \"ctas\": %lld, \"flush\": \"%s\", "
        "\"us\": %.2f, \"kv_tbps\": %.3f}\n",
        c.variant ? ("\"tile\": \"" + c.variant->name + "\", ").c_str() : "", named.c_str(),
        (long long)c.nk, (long long)c.page_bytes, (long long)page_rows, plan->splits,
        c.splits ? "true" : "false", plan->cluster ? "true" : "false", (long long)ctas,
        FlushName(clean), us, kv_bytes / us / 1e6);
    std::fflush(stdout);
  }
  if (c.anchors && !TimeAnchors(c.nk, pool, pool_bytes, c.page_bytes, m, sm_count, flush)) {
    return false;
  }
#ifdef ATTENTION_PAGED_TILE_SWEEP
  if (c.variant->trace && !PrintTrace(c, ctas, flush, step)) {
    return false;
  }
#endif
  for (void* p : {pool, q, o, lse, meta, workspace, tickets}) cudaFree(p);
  return true;
}

#ifdef ATTENTION_PAGED_TILE_SWEEP
template <typename Tile>
Variant MakeVariant(bool trace = false, bool clusters = true) {
  Variant v;
  v.name = std::to_string(Tile::kBc) + "keys_x" + std::to_string(Tile::kStages) + "stages_" +
           std::to_string(Tile::kWarps) + "warps" + (clusters ? "" : "_tickets") +
           (trace ? "_trace" : "");
  v.clusters = clusters;
  v.key_tile = Tile::kBc;
  v.launch = attention::cuda::LaunchPagedTile<Tile>;
  v.trace = trace;
  auto* kernel = attention::cuda::PagedDecodeKernel<Tile>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.ctas_per_sm, kernel, Tile::kThreads,
                                                Tile::kSmemBytes);
  // How many clusters of 2, 4 and 8 CTAs the GPU holds at once (its SMs in whole clusters per GPC).
  std::string line =
      "{\"variant\": \"" + v.name + "\", \"ctas_per_sm\": " + std::to_string(v.ctas_per_sm);
  for (int size : {2, 4, 8}) {
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim = {static_cast<unsigned>(size), 1, 1};
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(size, 64);
    config.blockDim = dim3(Tile::kThreads);
    config.dynamicSmemBytes = Tile::kSmemBytes;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = -1;
    cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    line += ", \"clusters_of_" + std::to_string(size) + "\": " + std::to_string(clusters);
  }
  std::printf("%s}\n", line.c_str());
  return v;
}

std::vector<Variant> Variants() {
  using attention::cuda::PagedTile;
  using T = __nv_bfloat16;
  return {MakeVariant<PagedTile<T, 128, 64, 4, 4>>(),
          MakeVariant<PagedTile<T, 128, 64, 5, 4>>(),
          MakeVariant<PagedTile<T, 128, 64, 3, 4>>(),
          MakeVariant<PagedTile<T, 128, 64, 4, 4>>(false, false),
          MakeVariant<PagedTile<T, 128, 64, 4, 4, GlobalTimerTrace>>(true),
          MakeVariant<PagedTile<T, 128, 64, 4, 4, GlobalTimerTrace>>(true, false)};
}
#endif

// --shapes's configurations (see the top of the file).
std::vector<Config> ShapeConfigs(int64_t nk) {
  const Shape shapes[] = {{"mla_hq128", 0, 128, 1, 576, 512},
                          {"mla_hq16", 0, 16, 1, 576, 512},
                          {"mla_latent_hq128", 0, 128, 1, 576, 512, true},
                          {"mla_latent_hq16", 0, 16, 1, 576, 512, true},
                          {"d512_gqa8", 0, 32, 4, 512, 512}};
  std::vector<Config> configs;
  for (const Shape& shape : shapes) {
    for (int64_t batch : {1, 8, 32, 64}) {
      Config c{nk, 512 << 10, 0};
      c.shape = shape;
      c.shape.batch = batch;
      configs.push_back(c);
    }
  }
  return configs;
}

bool Main(const std::vector<int64_t>& nks, bool shapes) {
  Device device;
  int major = 0, minor = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&device.sm_count, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  device.clusters = major == 9 && minor == 0;
  CHECK_CUDA(
      cudaDeviceGetAttribute(&device.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  Flush flush;
  CHECK_CUDA(cudaMalloc(&flush.buffer, flush.bytes));
  CHECK_CUDA(cudaMalloc(&flush.sink, sizeof(uint32_t)));
#ifdef ATTENTION_PAGED_TILE_SWEEP
  const std::vector<Variant> variants = Variants();
#endif
  for (int64_t nk : nks) {
    std::vector<Config> configs;
    if (shapes) {
      for (const Config& c : ShapeConfigs(nk)) {
        if (!TimeConfig(c, device, flush)) return false;
      }
      continue;
    }
#ifdef ATTENTION_PAGED_TILE_SWEEP
    for (const Variant& v : variants) configs.push_back({nk, 256 << 10, 0, &v});
#else
    for (int64_t page_bytes : {256 << 10, 512 << 10, 1 << 20})
      configs.push_back({nk, page_bytes, 0, nullptr, page_bytes == (256 << 10)});
    configs.push_back({nk, 512 << 10, 0, nullptr, false, /*clusters=*/false});
    for (int splits : {1, 3, 4, 8, 16, 32, 64}) configs.push_back({nk, 256 << 10, splits});
#endif
    for (const Config& c : configs) {
      if (!TimeConfig(c, device, flush)) return false;
    }
  }
  cudaFree(flush.buffer);
  cudaFree(flush.sink);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> nks;
  bool shapes = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--shapes") {
      shapes = true;
    } else {
      nks.push_back(std::atoll(argv[i]));
    }
  }
  if (nks.empty())
    nks = shapes ? std::vector<int64_t>{4096, 32768} : std::vector<int64_t>{4096, 32768, 131072};
  return Main(nks, shapes) ? 0 : 1;
}
