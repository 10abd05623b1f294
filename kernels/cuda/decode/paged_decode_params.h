// The plain-old-data view of one paged decode step (kernels/paged_kv.h) that the split-KV kernels
// take by value (paged_decode_kernel.cuh). Device pointers; lengths fit int32 (the planner checks).
#pragma once

#include <cstdint>

namespace attention::cuda {

// The most splits of one step (the merge keeps a weight per split in shared memory).
inline constexpr int kPagedMaxSplits = 256;
// The most splits that merge as one cluster. Pairs fill every SM of an H200 (66 clusters of 2 at
// one CTA per SM, 132 at two), larger clusters do not (30 of 4 or 15 of 8 at one CTA per SM: 120
// SMs; measured with cudaOccupancyMaxActiveClusters, bench/README.md), so a grid planned to fill
// the GPU would run a second wave.
inline constexpr int kPagedMaxClusterSplits = 2;

struct PagedKernelParams {
  const unsigned char* pool;
  int64_t page_bytes;
  int page_rows;
  const void* q;  // [Hq, Nq_s, D] per sequence, packed (kernels/paged_kv.h)
  void* o;        // [Hq, Nq_s, Dv] per sequence, packed
  float* lse;     // nullptr: not computed
  const int32_t* cu_seqlens_q;
  const int32_t* seqlens_k;
  const int32_t* page_table;
  int64_t page_table_stride;
  // head_dim: D, of q and k; v_head_dim: Dv, of v and o (MLA; D elsewhere). A page holds K
  // [Hkv, page_rows, D], then V [Hkv, page_rows, Dv]; with v_from_k K alone, V its rows' first
  // Dv columns (the SIMT kernel and the wide tile's instance for it read it so).
  int heads_q, heads_kv, group, head_dim, v_head_dim;
  bool v_from_k;
  // As KernelParams: exp2(scale_log2 * (q.k - max)) with scale_log2 > 0, Q negated for a negative
  // scale; window bounds -1 = unbounded.
  float scale_log2;
  bool negate_q;
  int window_left, window_right;
  // The open-model options (kernels/paged_kv.h). sinks: float32 [Hq] natural-log sink logits on
  // the device, nullptr: none (the finished rows' softmax denominators gain them: AddSink).
  // softcap_log2 > 0: the logits are capped, s2 = softcap_log2 * tanh(q.k * softcap_scale) in the
  // log2 domain (softcap_log2 = softcap log2(e), softcap_scale = |softmax_scale| / softcap, q
  // negated as for scale_log2; the tensor-core kernel has an instance for it,
  // PagedLaunch::softcap). chunk_size > 0: a row also sees only the keys in its diagonal key's
  // chunk; at most 2^30 (no larger chunk sees otherwise: the planner keeps lengths below 2^30).
  const float* sinks;
  float softcap_log2, softcap_scale;
  int chunk_size;
  // Grid: x = splits, y = heads_kv * m_blocks (16-row blocks of group * Nq), z = sequences.
  int m_blocks;
  int splits;
  int split_keys;  // keys per split, a multiple of the kernel's key tile
  // splits > 1 with cluster: the splits of a (sequence, grid row) form one thread-block cluster
  // (Hopper) and merge through distributed shared memory (MergeSplitsInCluster); no workspace.
  bool cluster;
  // splits > 1 without cluster: per split, a normalised float32 o [total_rows, Dv] and its
  // log2-sum-exp [total_rows] (-inf where the split saw no key); the last split CTA of each
  // (sequence, grid row) to finish merges them (MergeSplitsIfLast), counted by tickets
  // [sequences, grid y]: zero before the step, zero again after it (the merging CTA resets its
  // counter).
  float* part_o;
  float* part_lse;
  int32_t* tickets;
  int64_t total_rows;  // heads_q * total_q
};

}  // namespace attention::cuda
