// The paged KV cache's kernel interface: K/V rows of many sequences kept in fixed-size pages of
// one pool on a device, and a decode/extend step that attends new queries to them. The server's
// sessions own the page tables; a backend owns the pool's memory and the kernels.
//
// A page holds `page_rows` rows of one sequence, K then V:
//   page p starts at pool + p * page_bytes;
//   K: [Hkv, page_rows, D] of `dtype`, then V: [Hkv, page_rows, Dv] right after it (Dv, the V
//   head dim, is D unless the shape says otherwise: MLA models cache k of 192 and v of 128).
// page_rows = page_bytes / (Hkv * (D + Dv) * DTypeSize(dtype)), rounded down to a multiple of 16,
// so one pool serves sequences of any shape (a shape whose page_rows would be 0 cannot use it).
// A shape whose V is K's first Dv features (v_from_k: MLA's latent cache, k of 576 whose first 512
// are v, as FlashMLA reads it) keeps K alone: page_rows = page_bytes / (Hkv * D * size), and V's
// rows are K's, D apart.
// Row r of a sequence is row r % page_rows of page page_table[r / page_rows].
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention_params.h"

namespace attention {

// The shape every sequence of one step shares.
struct KvShape {
  DType dtype = DType::kFloat16;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;  // D, of q and k
  // Dv, of v and o; 0: D. Only a pool whose backend lists "v_head_dim" in its step options serves
  // Dv != D (the CPU's and the CUDA's); the others refuse it by name.
  int64_t v_head_dim = 0;
  // V is K's first Dv features, stored once (Dv at most D; served where v_head_dim is): writes
  // carry k alone, and a pool reads V from K's rows.
  bool v_from_k = false;

  int64_t value_head_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  // Elements of a page's row of V to the next: Dv, or D when V lies in K's rows.
  int64_t v_row_pitch() const { return v_from_k ? head_dim : value_head_dim(); }
  // Elements a page holds per row and kv head: K's D, and Dv more unless V lies in K.
  int64_t stored_dims() const { return head_dim + (v_from_k ? 0 : value_head_dim()); }
  bool operator==(const KvShape& other) const {
    return dtype == other.dtype && heads_kv == other.heads_kv && head_dim == other.head_dim &&
           value_head_dim() == other.value_head_dim() && v_from_k == other.v_from_k;
  }
};

// Rows per page for sequences of `shape` in pages of `page_bytes`; 0 when a page is too small.
int64_t PageRows(int64_t page_bytes, const KvShape& shape);

// Where a step's tensors are. Host memory by default: the pool reads and writes them before its
// call returns. `on_device`: the pool's own GPU memory (a co-located caller's CUDA regions), read
// and written there by the pool's kernels; a pool without a device refuses it. `ready` and `done`
// (cudaEvent_t of the caller's, or null): the pool's stream waits for `ready` before it reads the
// step's inputs and records `done` after its last write, and Decode then returns once the step is
// queued, not once it ran (its times are then 0).
struct StepMemory {
  bool on_device = false;
  void* ready = nullptr;
  void* done = nullptr;
  // Stream order by counters instead (StepRequest.ready_counter, done_counter): device addresses
  // of uint64s in the caller's memory; the stream waits until *ready_counter >= ready_value and
  // writes done_value to *done_counter. Null when not sent.
  uint64_t* ready_counter = nullptr;
  uint64_t ready_value = 0;
  uint64_t* done_counter = nullptr;
  uint64_t done_value = 0;

  bool stream_ordered() const { return done != nullptr || done_counter != nullptr; }
  // Spelled out: CUDA sources that include this compile as C++17.
  bool operator==(const StepMemory& other) const {
    return on_device == other.on_device && ready == other.ready && done == other.done &&
           ready_counter == other.ready_counter && ready_value == other.ready_value &&
           done_counter == other.done_counter && done_value == other.done_value;
  }
};

// Rows to append to a sequence: k and v host pointers with element strides, as KvWrite takes them
// (BHSD [Hkv, rows, D] or BSHD [rows, Hkv, D]; v with Dv; v null where the shape's v_from_k).
// What the server's request decoder makes of a message's k and v, and what its session store
// appends.
struct KvRows {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t rows = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  StepMemory memory;  // k and v on the device instead (on_device), and the step's events
};

// Writes rows [first_row, first_row + rows) of one sequence into its pages (all host pointers
// except the pool's). k is [Hkv, rows, D] (BHSD) or [rows, Hkv, D] (BSHD) of shape.dtype, v the
// same with Dv; the strides say which: k's, in elements, multiples of D (v's are k's / D * Dv,
// VStride: v is laid out as k, with rows of Dv). Where the shape's v_from_k, v is null: k's rows
// hold it.
struct KvWrite {
  KvShape shape;
  const int32_t* page_table = nullptr;  // the sequence's pages, covering first_row + rows
  int64_t first_row = 0;
  int64_t rows = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t head_stride = 0;  // between heads of k (of v: VStride)
  int64_t row_stride = 0;   // between rows of k (of v: VStride)
  StepMemory memory;        // KvRows's
};

// Reads rows [first_row, first_row + rows) of one sequence back out of its pages into host k and v
// (a session's export): the mirror of KvWrite, with the same layouts, strides and checks (v null
// where the shape's v_from_k: k holds it).
struct KvRead {
  KvShape shape;
  const int32_t* page_table = nullptr;  // the sequence's pages, covering first_row + rows
  int64_t first_row = 0;
  int64_t rows = 0;
  void* k = nullptr;
  void* v = nullptr;
  int64_t head_stride = 0;  // between heads of k (of v: VStride)
  int64_t row_stride = 0;   // between rows of k (of v: VStride)
};

// v's stride (elements) where k's is `k_stride` (a multiple of D): v is laid out as k, with rows
// of Dv.
inline int64_t VStride(const KvShape& shape, int64_t k_stride) {
  return k_stride / shape.head_dim * shape.value_head_dim();
}

// One decode/extend step over `num_seqs` sequences (one kernel launch where the backend can).
// Sequence s has seqlens_k[s] keys (already written, including this step's new rows) and
// Nq_s = cu_seqlens_q[s + 1] - cu_seqlens_q[s] queries, which are its last Nq_s positions: the
// mask is AttentionParams's bottom-right aligned window (causal = window_right 0).
//
// q of sequence s: [Hq, Nq_s, D] contiguous, starting at element Hq * cu_seqlens_q[s] * D; o the
// same with Dv (shape.value_head_dim()) for D; lse (optional, float32, natural log): [Hq, Nq_s]
// starting at Hq * cu_seqlens_q[s]. Or, with q_seqs set (q, o and lse then null), each sequence's
// own buffers of those shapes: q_seqs[s], o_seqs[s] and, when lse_seqs is set, lse_seqs[s]. A
// Step's sequences keep their rows apart, and a device pool gathers them straight into its pinned
// staging and scatters o and lse from there: packing them first would be one more copy of every row
// each way. Query head h reads kv head h / (Hq / Hkv).
struct PagedDecodeParams {
  KvShape shape;
  int64_t heads_q = 0;
  int64_t num_seqs = 0;

  const void* q = nullptr;
  void* o = nullptr;
  float* lse = nullptr;                   // nullptr: not computed
  const void* const* q_seqs = nullptr;    // [num_seqs], instead of q
  void* const* o_seqs = nullptr;          // [num_seqs], instead of o
  float* const* lse_seqs = nullptr;       // [num_seqs], instead of lse; nullptr: not computed
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]
  int64_t total_q = 0;                    // cu_seqlens_q[num_seqs]
  int64_t max_seqlen_q = 0;

  const int32_t* seqlens_k = nullptr;  // [num_seqs]
  int64_t max_seqlen_k = 0;
  // page_table[s * page_table_stride + i] is sequence s's i-th page.
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;

  float softmax_scale = 1.0f;
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  // AttentionParams's open-model options (the V head dim is the shape's): per query head sink
  // logits (float32 [Hq], host memory), a logit softcap, a chunk size.
  const float* sinks = nullptr;
  float softcap = 0.0f;
  int64_t chunk_size = 0;

  // As AttentionParams::stop: checked between tiles; CANCELLED once set.
  const std::atomic<bool>* stop = nullptr;
  // q, o and lse on the pool's device instead of the host, and the step's events. The host
  // arrays (cu_seqlens_q, seqlens_k, page_table, sinks) stay host memory.
  StepMemory memory;
};

// OK when `memory` is the host's with no events, else UNIMPLEMENTED naming `backend` (a pool
// without a device).
absl::Status RefuseDeviceMemory(const StepMemory& memory, const char* backend);

// Step times, microseconds (copies are 0 on the CPU).
struct KvStepTimes {
  double h2d_us = 0;
  double compute_us = 0;
  double d2h_us = 0;
};

// One page of a pool and the host memory (page_bytes of it) it moves to or from: the session
// store's host tier, where cold sessions' pages wait while the pool is full.
struct HostPage {
  int32_t page = 0;
  unsigned char* host = nullptr;
};

// Host memory of a host tier (KvPagePool::AllocateHost), freed when the last copy goes.
using HostBuffer = std::shared_ptr<unsigned char>;

// OK when every page is in [0, num_pages), listed once, with host memory; else INVALID_ARGUMENT
// naming it.
absl::Status CheckHostPages(absl::Span<const HostPage> pages, int64_t num_pages);

// A pool of `num_pages` pages of `page_bytes` on one device. Write and Decode take host pointers
// (q, o, lse, page tables, lengths), or device pointers where their StepMemory says so. Write takes
// the rows of any number of sequences (a step's new tokens in one call: a device pool then moves
// them in one copy and one kernel); it checks every write before doing any, and returns once it has
// taken the rows: the caller may reuse its buffers, while a device pool may still be copying them,
// ordered before every later call (a copy's failure then surfaces in a later call). CopyPages
// copies whole pages within the pool (a forked session's partial last page, copy on write): page
// src_dst[i].second becomes a copy of src_dst[i].first; it checks every pair first (pages in the
// pool, no destination also a source or listed twice) and is ordered as a Write: after every
// earlier call's writes, before every later call's. Read copies one sequence's rows out to host
// memory, after every earlier call's writes, and returns once they are there (checked as a Write).
// Decode returns when o and lse are written. Thread-safe.
class KvPagePool {
 public:
  virtual ~KvPagePool() = default;
  virtual int64_t page_bytes() const = 0;
  virtual int64_t num_pages() const = 0;
  virtual absl::Status Write(absl::Span<const KvWrite> writes) = 0;
  virtual absl::Status CopyPages(absl::Span<const std::pair<int32_t, int32_t>> src_dst) = 0;
  virtual absl::Status Read(const KvRead& read) = 0;
  virtual absl::StatusOr<KvStepTimes> Decode(const PagedDecodeParams& host_params) = 0;

  // The host tier (the session store's, see server/sessions/session_store.h). AllocateHost:
  // `bytes` of host memory the pool copies pages to and from at its fastest (pinned on a GPU's
  // pool, plain on the CPU's). SavePages copies each pages[i].page to pages[i].host, after every
  // earlier call's writes, and returns once the bytes are on the host (the page may then be
  // reused). LoadPages copies each pages[i].host into pages[i].page, before every later call's
  // reads, and returns once copied (the host memory may then be reused). Both are checked by
  // CheckHostPages first. A pool without a host tier answers UNIMPLEMENTED (these defaults).
  virtual absl::StatusOr<HostBuffer> AllocateHost(int64_t bytes);
  virtual absl::Status SavePages(absl::Span<const HostPage> pages);
  virtual absl::Status LoadPages(absl::Span<const HostPage> pages);
};

}  // namespace attention
