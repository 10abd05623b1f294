// Host-side helpers every KvPagePool shares (kernels/paged_kv.h): the checks of a Write or a
// Decode step against the pool (so that no kernel reads or writes outside it), and the page runs a
// Write copies.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/paged_kv.h"

namespace attention {

// What a checked decode step looks like (lengths recomputed from the host arrays, so the kernels'
// grids never trust the caller's max_seqlen_*).
struct DecodeExtent {
  int64_t page_rows = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
};

// Checks shape, pointers, cu_seqlens_q (monotonic, ending at total_q), seqlens_k (>= 0) and that
// every page a sequence's keys need is in [0, num_pages) and within page_table_stride.
absl::StatusOr<DecodeExtent> CheckPagedDecode(const PagedDecodeParams& p, int64_t page_bytes,
                                              int64_t num_pages);

// Whether the step asks for lse, in either form of PagedDecodeParams.
inline bool DecodeWantsLse(const PagedDecodeParams& p) {
  return p.q_seqs != nullptr ? p.lse_seqs != nullptr : p.lse != nullptr;
}

// Copies the step's q, packed ([Hq * total_q, D] of its dtype), to `dst`: every sequence's rows
// from its own buffer (q_seqs), or q at once when it is packed already.
void GatherDecodeQ(const PagedDecodeParams& p, void* dst);

// Copies packed o ([Hq * total_q, Dv]) and, when the step asks for it, lse ([Hq * total_q]) out to
// where the step keeps them.
void ScatterDecodeOutputs(const PagedDecodeParams& p, const void* o, const float* lse);

// K and V (2), or K alone where V lies in it (1): the parts of a row a Write copies.
inline int KvParts(const KvShape& shape) { return shape.v_from_k ? 1 : 2; }

// Checks shape, pointers, strides and the pages rows [first_row, first_row + rows) land in.
absl::StatusOr<int64_t> CheckKvWrite(const KvWrite& w, int64_t page_bytes, int64_t num_pages);

// The Write of the rows `read` reads (its k and v as the source): what CheckKvWrite checks and
// ForEachPageRun walks for a Read.
inline KvWrite AsKvWrite(const KvRead& read) {
  KvWrite w;
  w.shape = read.shape;
  w.page_table = read.page_table;
  w.first_row = read.first_row;
  w.rows = read.rows;
  w.k = read.k;
  w.v = read.v;
  w.head_stride = read.head_stride;
  w.row_stride = read.row_stride;
  return w;
}

// Checks CopyPages' pairs (src, dst): every page in [0, num_pages), no destination also a source or
// twice a destination (the copies would then depend on their order).
absl::Status CheckPageCopies(absl::Span<const std::pair<int32_t, int32_t>> src_dst,
                             int64_t num_pages);

// One run of a Write: `count` rows starting at source row `src_row` (0-based within the write)
// that land in page `page` from row `page_row` on.
struct PageRun {
  int64_t page, page_row, src_row, count;
};
// Calls fn for each run of w's rows within one page, in row order; stops at the first error.
absl::Status ForEachPageRun(const KvWrite& w, int64_t page_rows,
                            const std::function<absl::Status(const PageRun&)>& fn);

// Byte offsets inside a page of sequences of `shape` with `page_rows` rows (kernels/paged_kv.h):
// K of (head, row), where V starts, and V of (head, row) (K's, where V lies in K's rows; its rows
// are then shape.v_row_pitch() elements apart).
inline int64_t KvRowOffset(const KvShape& shape, int64_t page_rows, int64_t head, int64_t row) {
  return (head * page_rows + row) * shape.head_dim * static_cast<int64_t>(DTypeSize(shape.dtype));
}
inline int64_t VOffset(const KvShape& shape, int64_t page_rows) {
  return KvRowOffset(shape, page_rows, shape.heads_kv, 0);
}
inline int64_t VRowOffset(const KvShape& shape, int64_t page_rows, int64_t head, int64_t row) {
  if (shape.v_from_k) return KvRowOffset(shape, page_rows, head, row);
  return VOffset(shape, page_rows) + (head * page_rows + row) * shape.value_head_dim() *
                                         static_cast<int64_t>(DTypeSize(shape.dtype));
}

}  // namespace attention
