// One paged decode step on the device (kernels/paged_kv.h): the split-KV plan (how many splits,
// which kernel) and its launch on a stream. The CUDA pool (paged_kv_pool.cc) and the decode bench
// (bench/cuda/decode_bench.cu) call it with device pointers.
//
// Head dims: float16 and bfloat16 with head_dim a multiple of 8 up to 128 and V of the same head
// dim run on tensor cores (tiles for D = 64 and 128), and so do (D, Dv) = (576, 512) (MLA's
// absorbed decode) and (512, 512) without a softcap, on the wide tile (64 rows per CTA) where the
// device's blocks may opt in to its shared memory (Hopper; PagedPlanOptions::smem_per_block);
// every other head dim up to 576, a V head dim of its own (Dv != D, up to 576: MLA's QK 192 / V
// 128), and float32, run on the SIMT kernel (correct, not fast). Larger head dims are
// INVALID_ARGUMENT.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/decode/paged_decode_launchers.h"
#include "kernels/paged_kv.h"
#include "kernels/paged_kv_host.h"

namespace attention::cuda {

struct PagedDecodePlan {
  PagedLaunch launch;
  int key_tile = 0;  // keys per tile of the chosen kernel; splits are whole tiles
  int splits = 1;
  int split_keys = 0;
  int m_blocks = 0;
  // splits > 1 on a tensor-core tile of a device with clusters: a row block's splits run as one
  // thread-block cluster and merge through its distributed shared memory (no workspace, no
  // tickets).
  bool cluster = false;
  size_t workspace_bytes = 0;  // float32 partials when splits > 1 without cluster
  // int32 tickets when splits > 1 without cluster (one per sequence x kv head x 16-row block): the
  // split CTAs of a row block count themselves on it, and the last merges
  // (paged_decode_kernel.cuh).
  int64_t tickets = 0;
};

struct PagedPlanOptions {
  int sm_count = 132;  // the device's multiprocessors
  int splits = 0;      // > 0: this many splits (at most one per key tile) instead of the heuristic
  // For kernels other than the default ones (the tile sweep): CTAs resident per SM and keys per
  // tile; 0: the default kernel's.
  int ctas_per_sm = 0;
  int key_tile = 0;
  // Whether the kernels may merge splits in thread-block clusters: the device runs their sm_90a
  // code (compute capability 9.0), where the cluster merge is compiled.
  bool clusters = false;
  // Bytes of shared memory a block may opt in to on the device: the wide tile
  // (PagedWideSmemBytes) runs where it fits; 0: nowhere.
  int smem_per_block = 0;
};

// Plans a step checked by CheckPagedDecode (host params: reads cu_seqlens_q[0]). Splits (at most
// one per key tile, kPagedMaxSplits in all): the fewest whose grid fills its last wave of
// sm_count x ctas_per_sm CTAs within 90% as well as the best split count does. Measured on the
// H200 (bench/README.md), one full wave beats two or more: every split adds a prologue, partial
// results and merge traffic, while a wave's CTAs already keep the memory system busy. Up to
// kPagedMaxClusterSplits splits on a tensor-core tile merge in a cluster where options.clusters
// says so; more, or the SIMT kernel, through a global workspace and tickets.
absl::StatusOr<PagedDecodePlan> PlanPagedDecode(const PagedDecodeParams& host,
                                                const DecodeExtent& extent,
                                                const PagedPlanOptions& options);

// The kernels' view of a planned step (device pointers as for LaunchPagedDecode).
PagedKernelParams ToPagedKernelParams(const PagedDecodePlan& plan, const void* pool,
                                      int64_t page_bytes, const DecodeExtent& extent,
                                      const PagedDecodeParams& dev, void* workspace,
                                      int32_t* tickets);

// Enqueues the step on `stream`: one kernel launch. dev: PagedDecodeParams with device pointers
// (q, o, lse, cu_seqlens_q, seqlens_k, page_table, sinks); pool: the device pages; workspace:
// plan.workspace_bytes of device memory (256-byte aligned); tickets: plan.tickets int32 of device
// memory, all zero, which the step leaves zero (keep them for the next step; no memset per step).
absl::Status LaunchPagedDecode(const PagedDecodePlan& plan, const void* pool, int64_t page_bytes,
                               const DecodeExtent& extent, const PagedDecodeParams& dev,
                               void* workspace, int32_t* tickets, cudaStream_t stream);

}  // namespace attention::cuda
