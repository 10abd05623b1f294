#include "kernels/cuda/runtime/launch_plan.h"

#include <algorithm>
#include <cstdint>

namespace attention::cuda {
namespace {

constexpr int64_t kAlign = 256;

int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Dense q is [B, N, H, D] (rows advance by H*D); with one head both layouts are the same memory.
bool IsBshd(const AttentionParams& p) { return p.q_row_stride == p.heads_q * p.head_dim; }
// Packable as varlen rows: varlen already, or dense BSHD.
bool Packable(const AttentionParams& p) { return p.is_varlen() || IsBshd(p); }

// Whether the mask hides some keys from some rows (a causal or window mask). Without one, the only
// keys a row cannot see are those past Nk, which the kernel zero-fills.
bool Masked(const AttentionParams& p) {
  return p.window_left != kUnboundedWindow || p.window_right != kUnboundedWindow ||
         p.chunk_size > 0;
}

bool CopiesDirectly(Home home) { return home != Home::kPageable; }

}  // namespace

bool CanShareLaunch(const AttentionParams& a, const AttentionParams& b) {
  if (a.dtype != b.dtype || a.heads_q != b.heads_q || a.heads_kv != b.heads_kv ||
      a.head_dim != b.head_dim || a.softmax_scale != b.softmax_scale ||
      a.q_descale != b.q_descale || a.k_descale != b.k_descale || a.v_descale != b.v_descale ||
      a.window_left != b.window_left || a.window_right != b.window_right ||
      a.mask_alignment != b.mask_alignment || (a.lse == nullptr) != (b.lse == nullptr) ||
      a.has_open_model_options() || b.has_open_model_options()) {
    return false;
  }
  const bool same_dense = !a.is_varlen() && !b.is_varlen() && IsBshd(a) == IsBshd(b) &&
                          a.seqlen_q == b.seqlen_q && a.seqlen_k == b.seqlen_k;
  return same_dense || (Packable(a) && Packable(b));
}

bool IsOneLaunch(absl::Span<const AttentionParams> items) {
  return std::all_of(items.begin() + 1, items.end(),
                     [&](const AttentionParams& item) { return CanShareLaunch(items[0], item); });
}

std::vector<VScan> PlanVScan(absl::Span<const AttentionParams> items,
                             absl::Span<const TensorHomes> homes) {
  std::vector<VScan> scan(items.size(), VScan::kNone);
  if (items.empty() || !Masked(items[0])) return scan;
  for (size_t i = 0; i < items.size(); ++i) {
    scan[i] = homes[i].v == Home::kDevice ? VScan::kDevice : VScan::kHost;
  }
  return scan;
}

int64_t Packing::Regions(int64_t line_elems, size_t in_elem, size_t out_elem, bool lse,
                         const Float8Path& path) {
  const size_t dequantised_elem = path.dequantised_elem();
  const int64_t q = lines_q * line_elems * in_elem, k = lines_k * line_elems * in_elem;
  const int64_t o = lines_q * line_elems * out_elem;
  const int64_t q16 = lines_q * line_elems * dequantised_elem;
  const int64_t k16 = lines_k * line_elems * dequantised_elem;
  const int64_t lse_bytes = lse ? lines_q * int64_t{sizeof(float)} : 0;
  const int64_t cu = varlen ? (sequences + 1) * int64_t{sizeof(int32_t)} : 0;
  const int64_t sizes[kEnd] = {q, k, k, o, lse_bytes, cu, cu, q16, k16, k16, path.workspace_bytes};
  for (int i = 0; i < kEnd; ++i) offsets[i + 1] = offsets[i] + RoundUp(sizes[i], kAlign);
  return offsets[kEnd];
}

Packing Pack(absl::Span<const AttentionParams> items) {
  const AttentionParams& first = items[0];
  Packing p;
  for (const AttentionParams& item : items) {
    p.varlen = p.varlen || item.is_varlen() || item.seqlen_q != first.seqlen_q ||
               item.seqlen_k != first.seqlen_k;
    p.line_q.push_back(p.lines_q);
    p.line_k.push_back(p.lines_k);
    p.row_q.push_back(p.rows_q);
    p.lines_q += RowsQ(item) * item.heads_q;
    p.lines_k += RowsK(item) * item.heads_kv;
    p.rows_q += RowsQ(item);
    p.sequences += item.batch;
  }
  return p;
}

LaunchPlan PlanLaunch(absl::Span<const AttentionParams> items, absl::Span<const TensorHomes> homes,
                      const Float8Path& float8) {
  const AttentionParams& first = items[0];
  const size_t elem = DTypeSize(first.dtype);                 // q, k, v as they come
  const size_t o_elem = DTypeSize(OutputDType(first.dtype));  // o
  const bool with_lse = first.lse != nullptr;
  LaunchPlan plan;
  plan.head_dim = first.head_dim;
  plan.padded_head_dim = PaddedHeadDim(first.head_dim);
  const int64_t d = plan.head_dim, d8 = plan.padded_head_dim;
  plan.float8 = float8;
  plan.device = Pack(items);
  plan.staging = plan.device;
  plan.device_bytes = plan.device.Regions(d8, elem, o_elem, with_lse, float8);
  plan.staging_bytes = plan.staging.Regions(d, elem, o_elem, with_lse);

  // One dense request whose q, k, v and o are all in this device's memory (a client's CUDA IPC
  // region) with no padding to D8: the kernel reads and writes them where they are, no copy. The
  // kernel moves 16-byte chunks, so each must start on 16 bytes (a region reference is only
  // checked against its element size); others are copied (cudaMemcpy takes any alignment).
  auto in_place_ok = [](const void* p, Home home) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && home == Home::kDevice;
  };
  const TensorHomes& home0 = homes[0];
  plan.in_place = items.size() == 1 && d8 == d && !plan.device.varlen && !first.is_varlen() &&
                  in_place_ok(first.q, home0.q) && in_place_ok(first.k, home0.k) &&
                  in_place_ok(first.v, home0.v) && in_place_ok(first.o, home0.o);
  plan.lse_on_device.assign(items.size(), false);
  for (size_t i = 0; i < items.size() && with_lse; ++i) {
    plan.lse_on_device[i] = homes[i].lse == Home::kDevice;
    plan.lse_to_host = plan.lse_to_host || !plan.lse_on_device[i];
  }
  plan.lse_in_place = plan.in_place && with_lse && plan.lse_on_device[0];
  // In place, the stream's buffers hold only float8's bfloat16 copies or workspace and an lse that
  // goes to the host: q, k, v and o need none, so without those they are neither allocated nor
  // grown.
  plan.reserve_buffers = !plan.in_place || float8.dequantise || float8.workspace_bytes > 0 ||
                         (with_lse && !plan.lse_in_place);

  // The launch's lengths: varlen cu_seqlens from every item's own (varlen) or from its B items of
  // N rows (dense).
  if (plan.device.varlen) {
    plan.cu_seqlens_q.assign(1, 0);
    plan.cu_seqlens_k.assign(1, 0);
    int64_t row_q = 0, row_k = 0;
    for (const AttentionParams& item : items) {
      for (int64_t b = 0; b < item.batch; ++b) {
        const int64_t nq =
            item.is_varlen() ? item.cu_seqlens_q[b + 1] - item.cu_seqlens_q[b] : item.seqlen_q;
        const int64_t nk =
            item.is_varlen() ? item.cu_seqlens_k[b + 1] - item.cu_seqlens_k[b] : item.seqlen_k;
        row_q += nq;
        row_k += nk;
        plan.cu_seqlens_q.push_back(static_cast<int32_t>(row_q));
        plan.cu_seqlens_k.push_back(static_cast<int32_t>(row_k));
        plan.seqlen_q = std::max(plan.seqlen_q, nq);
        plan.seqlen_k = std::max(plan.seqlen_k, nk);
      }
    }
    plan.total_k = row_k;
    plan.layout = Layout::kBSHD;
  } else {
    plan.seqlen_q = first.seqlen_q;
    plan.seqlen_k = first.seqlen_k;
    plan.layout = IsBshd(first) ? Layout::kBSHD : Layout::kBHSD;
  }

  plan.o_staged.assign(items.size(), false);
  plan.copies_to_device = !plan.in_place;
  plan.copies_to_host = !plan.in_place || plan.lse_to_host;
  if (plan.in_place) return plan;

  // Inputs: each item's lines go to its place in the device buffer, from its own memory when that
  // is pinned or on the device, else through staging, where consecutive staged items form one run
  // and one DMA. Tensor by tensor, so the DMA of q overlaps the staging memcpys of k.
  for (int region = Packing::kQ; region <= Packing::kV; ++region) {
    const std::vector<int64_t>& first_line =
        region == Packing::kQ ? plan.device.line_q : plan.device.line_k;
    int64_t run_start = 0, run_end = 0;  // staged lines not yet sent
    for (size_t i = 0; i <= items.size(); ++i) {
      const bool end = i == items.size();
      const Home home = end                     ? Home::kPinned
                        : region == Packing::kQ ? homes[i].q
                        : region == Packing::kK ? homes[i].k
                                                : homes[i].v;
      const bool staged = !end && !CopiesDirectly(home);
      if (!staged && run_end > run_start) {
        plan.copies_in.push_back({CopyStep::kStagedRun, region, 0, run_start, run_end - run_start});
        run_start = run_end;
      }
      if (end) break;
      const int64_t lines = region == Packing::kQ ? RowsQ(items[i]) * items[i].heads_q
                                                  : RowsK(items[i]) * items[i].heads_kv;
      if (staged) {
        if (run_end == run_start) run_start = run_end = first_line[i];
        plan.copies_in.push_back({CopyStep::kStage, region, i, first_line[i], lines});
        run_end += lines;
      } else {
        plan.copies_in.push_back({CopyStep::kDirect, region, i, first_line[i], lines});
      }
    }
  }
  // Outputs: o straight into a pinned (or device) destination, else into staging (consecutive
  // staged items in one DMA) and unstaged on the host after the copies (o_staged).
  int64_t run_start = 0, run_end = 0;
  for (size_t i = 0; i <= items.size(); ++i) {
    const bool staged = i < items.size() && !CopiesDirectly(homes[i].o);
    if (i < items.size()) plan.o_staged[i] = staged;
    if (!staged && run_end > run_start) {
      plan.copies_out.push_back(
          {CopyStep::kStagedRun, Packing::kO, 0, run_start, run_end - run_start});
      run_start = run_end;
    }
    if (i == items.size()) break;
    const int64_t lines = RowsQ(items[i]) * items[i].heads_q;
    if (staged) {
      if (run_end == run_start) run_start = run_end = plan.device.line_q[i];
      run_end += lines;
    } else {
      plan.copies_out.push_back({CopyStep::kDirect, Packing::kO, i, plan.device.line_q[i], lines});
    }
  }
  return plan;
}

AttentionParams LaunchParams(const LaunchPlan& plan, const AttentionParams& first, char* device) {
  auto at = [&](int region) -> char* {
    return device == nullptr ? nullptr : device + plan.device.offsets[region];
  };
  // The launch: items concatenated along B, or packed as varlen [total, H, D].
  AttentionParams launch = first;
  launch.head_dim = plan.padded_head_dim;
  launch.q = at(Packing::kQ);
  launch.k = at(Packing::kK);
  launch.v = at(Packing::kV);
  launch.o = at(Packing::kO);
  launch.lse = first.lse != nullptr ? reinterpret_cast<float*>(at(Packing::kLse)) : nullptr;
  launch.batch = plan.device.sequences;
  launch.seqlen_q = plan.seqlen_q;
  launch.seqlen_k = plan.seqlen_k;
  if (plan.device.varlen) {
    launch.cu_seqlens_q = reinterpret_cast<const int32_t*>(at(Packing::kCuQ));
    launch.cu_seqlens_k = reinterpret_cast<const int32_t*>(at(Packing::kCuK));
    launch.total_q = plan.device.rows_q;
    launch.total_k = plan.total_k;
  } else {
    launch.cu_seqlens_q = launch.cu_seqlens_k = nullptr;
  }
  launch.SetContiguousStrides(plan.layout);
  if (plan.in_place) {
    launch.q = first.q;
    launch.k = first.k;
    launch.v = first.v;
    launch.o = first.o;
    // A lone dense request's lse [B, H, N] is the launch's.
    if (plan.lse_in_place) launch.lse = first.lse;
  }
  if (plan.float8.dequantise) {
    launch.dtype = DType::kBFloat16;
    launch.q = at(Packing::kQ16);
    launch.k = at(Packing::kK16);
    launch.v = at(Packing::kV16);
  }
  return launch;
}

}  // namespace attention::cuda
