// The host runner's launch plan: every decision HostRunner makes about a batch before it touches
// the device, as a plain struct computed by pure functions from the items, where their tensors
// lie and how the forward plan serves float8. Host-only (no CUDA header, no CUDA call), so the
// decisions are unit-tested without a GPU, in a CPU-only build too
// (tests/kernels/launch_plan_test.cc).
//
// A batch (items pairwise CanShareLaunch) is one launch over one device buffer, laid out
//   q | k | v | o | lse | cu_q | cu_k | q16 | k16 | v16 | workspace   (each region 256-byte
//   aligned)
// with items packed one after another: concatenated along B (dense, equal lengths) or as varlen
// [total, H, D] rows with cu_seqlens built here. q16, k16, v16 are the bfloat16 copies of float8
// inputs the kernel reads when they are dequantised first, workspace the launch's own (float8 V
// transposed); both in the device buffer only. The device buffer has lines of D8 = roundup(D, 8)
// elements (D not a multiple of 8 is zero-padded), the pinned staging buffer lines of D.
//
// What it decides:
//   - which items take the exact CPU path's V scan, and where V is scanned (host or device);
//   - the packing (concatenated or varlen) and the buffers' sizes;
//   - in place: a lone dense request with q, k, v and o in this device's memory, each on 16 bytes,
//     D a multiple of 8, runs on its own tensors with no copy (lse too when it is on the device);
//   - per item and tensor, staged (host memcpy into pinned staging, then DMA) or direct (pinned
//     or device memory, DMA'd as it is), and the order of copies: consecutive staged items share
//     one DMA, issued when the run ends, so the DMA of q overlaps the staging memcpys of k;
//   - lse: into staging and unpacked on the host, or copied device to device per item.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/attention_params.h"

namespace attention::cuda {

// Whether requests `a` and `b` can share one launch: same dtype, heads, head dim, scale, descales,
// window and lse request, and either both dense in the same layout with equal lengths (concatenated
// along B) or both BSHD-or-varlen (packed as varlen). Host-side and cheap; the scheduler groups by
// it.
// A request with open-model options (sinks, softcap, chunks) shares with no other request: the
// launch carries one request's options, and its sinks are that request's own array.
bool CanShareLaunch(const AttentionParams& a, const AttentionParams& b);

// Whether `items` (not empty) run as one launch: each item after the first CanShareLaunch with
// items[0]. items[0] is not compared with itself, so a lone request runs whatever CanShareLaunch
// says of it (a request with options shares with no other, but alone it is a launch).
bool IsOneLaunch(absl::Span<const AttentionParams> items);

// Query rows and key rows of p over all its sequences.
inline int64_t RowsQ(const AttentionParams& p) {
  return p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
}
inline int64_t RowsK(const AttentionParams& p) {
  return p.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
}
// The head dim the device buffers and kernel use: D rounded up to 8.
inline int64_t PaddedHeadDim(int64_t head_dim) { return (head_dim + 7) / 8 * 8; }

// Where a tensor's memory is, as the runner's copies see it (cudaPointerGetAttributes).
enum class Home {
  kPageable,  // ordinary host memory (or anything else): copied through pinned staging
  kPinned,    // pinned or registered host memory: DMA'd directly
  kDevice,    // this device's memory (a client's CUDA IPC region): copied device to device
};
struct TensorHomes {
  Home q = Home::kPageable, k = Home::kPageable, v = Home::kPageable, o = Home::kPageable;
  Home lse = Home::kPageable;  // ignored without lse
};

// Where a masked item's V is scanned for Inf and NaN (a masked request whose V holds one runs on
// the exact CPU kernel; host_runner.h, "What falls back").
enum class VScan { kNone, kHost, kDevice };
// Per item: kNone for all when the batch is unmasked (its only unseen keys, past Nk, are
// zero-filled on the device); else kDevice where V is in this device's memory, kHost elsewhere.
std::vector<VScan> PlanVScan(absl::Span<const AttentionParams> items,
                             absl::Span<const TensorHomes> homes);

// How a launch serves float8 inputs: the forward plan's kernel reads them as they are (wgmma_sm90
// on dense calls at head dims 128 and 256, with V transposed into a workspace), or they are
// dequantised to bfloat16 copies first (prep/dequantise.h) for the kernels that take no float8.
struct Float8Path {
  bool dequantise = false;
  int64_t workspace_bytes = 0;  // the launch's workspace (ForwardPlan::workspace_bytes)
  // Bytes per element of the kernel's copies of q, k, v: 0 when it reads them as they come.
  size_t dequantised_elem() const { return dequantise ? DTypeSize(DType::kBFloat16) : 0; }
};

// The regions of one buffer (device or staging) for items packed one after another.
struct Packing {
  // Region indices into offsets.
  enum { kQ, kK, kV, kO, kLse, kCuQ, kCuK, kQ16, kK16, kV16, kWorkspace, kEnd };
  bool varlen = false;  // packed as varlen [total, H, D] (else concatenated along B)
  int64_t lines_q = 0;  // rows * heads, all items
  int64_t lines_k = 0;
  int64_t rows_q = 0;     // query rows, all items (the lse's inner extent when varlen)
  int64_t sequences = 0;  // batch items after packing
  std::vector<int64_t> line_q, line_k, row_q;  // per item: first q line, k line and q row
  int64_t offsets[kEnd + 1] = {0};             // region starts; offsets[kEnd] is the total

  // Sizes the regions for lines of line_elems elements of in_elem bytes (q, k, v), out_elem (o),
  // float8's `path` (dequantised copies of q, k, v, or a workspace); returns the total.
  int64_t Regions(int64_t line_elems, size_t in_elem, size_t out_elem, bool lse,
                  const Float8Path& path = {});
};
Packing Pack(absl::Span<const AttentionParams> items);

// Where item i's lse lies in the launch's packed lse (region kLse): calls
// piece(dst, dst_pitch, src, src_pitch, width, height) for blocks of `height` lines of `width`
// floats, pitches in floats, src an offset into the packed lse. Packed dense lse is [B, H, N]
// slices one after another (one block per item); packed varlen lse is [H, total rows], and the
// item's is [H, total_i] (varlen) or [B, H, N] (dense: one block per batch item).
template <typename Piece>
void ForEachLsePiece(const AttentionParams& item, const Packing& pack, size_t i, Piece piece) {
  const int64_t rows = RowsQ(item), heads = item.heads_q;
  if (!pack.varlen) {
    piece(item.lse, rows * heads, pack.line_q[i], rows * heads, rows * heads, 1);
  } else if (item.is_varlen()) {
    piece(item.lse, rows, pack.row_q[i], pack.rows_q, rows, heads);
  } else {
    for (int64_t b = 0; b < item.batch; ++b) {
      piece(item.lse + b * heads * item.seqlen_q, item.seqlen_q, pack.row_q[i] + b * item.seqlen_q,
            pack.rows_q, item.seqlen_q, heads);
    }
  }
}

// One copy of a launch's q, k or v in (or o out), in the order the runner issues them.
struct CopyStep {
  enum Kind {
    kStage,      // in: the item's tensor, memcpy'd into staging at `line` (host, at once)
    kStagedRun,  // staging lines [line, line + lines) DMA'd to (in) or from (out) the device
    kDirect,     // the item's own memory DMA'd to (in) or from (out) device lines [line, +lines)
  };
  Kind kind = kStage;
  int region = Packing::kQ;  // kQ, kK, kV (in) or kO (out)
  size_t item = 0;           // kStage and kDirect: whose tensor
  int64_t line = 0;
  int64_t lines = 0;
  bool operator==(const CopyStep&) const = default;
};

struct LaunchPlan {
  int64_t head_dim = 0;         // the items' D
  int64_t padded_head_dim = 0;  // D8, the launch's head dim
  Float8Path float8;
  Packing device;   // device buffer regions (lines of D8)
  Packing staging;  // pinned staging regions (lines of D)
  int64_t device_bytes = 0, staging_bytes = 0;
  // The stream's buffers are grown to device_bytes and staging_bytes; false only in place with
  // nothing left for them (no float8 copies or workspace, lse in place or absent).
  bool reserve_buffers = true;
  bool in_place = false;      // the lone item's q, k, v, o are the launch's (no copy)
  bool lse_in_place = false;  // its lse too
  // Per item: its lse is in this device's memory (copied device to device from the packed lse,
  // or written in place); lse_to_host: some item's is not (packed lse DMA'd to staging).
  std::vector<bool> lse_on_device;
  bool lse_to_host = false;
  // The launch as dense [sequences, ...] concatenated along B in the first item's layout, or
  // varlen with these cu_seqlens ([sequences + 1] each), max lengths and key rows.
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k;
  int64_t seqlen_q = 0, seqlen_k = 0, total_k = 0;
  Layout layout = Layout::kBHSD;     // the launch's layout when dense (varlen is BSHD rows)
  std::vector<CopyStep> copies_in;   // q, then k, then v; none in place
  std::vector<CopyStep> copies_out;  // o; none in place
  std::vector<bool> o_staged;        // per item: o unstaged from staging on the host after the DMA
  // The timed stages that copy anything (else their times are 0).
  bool copies_to_device = true;
  bool copies_to_host = true;
};

// The plan of one launch of `items` (pairwise CanShareLaunch with items[0], not empty) whose
// tensors lie at `homes` (one per item), with float8 served by `float8` (Float8Path{} for other
// dtypes). Pure: reads the items' cu_seqlens (host arrays) and pointer values (alignment), nothing
// else.
LaunchPlan PlanLaunch(absl::Span<const AttentionParams> items, absl::Span<const TensorHomes> homes,
                      const Float8Path& float8);

// The launch's params: `first`'s (items[0] of the plan), with head dim D8, batch = the packed
// sequences, the plan's lengths and layout, and its tensors in their regions of the device buffer
// at `device` (null while the stream holds none), cu_seqlens too when varlen. In place, the item's
// own q, k, v, o (and lse when lse_in_place). float8 dequantised first: bfloat16 read from q16,
// k16, v16, the descales kept for the kernel to fold in (prep/dequantise.h).
AttentionParams LaunchParams(const LaunchPlan& plan, const AttentionParams& first, char* device);

}  // namespace attention::cuda
