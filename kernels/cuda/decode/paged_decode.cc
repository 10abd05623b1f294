#include "kernels/cuda/decode/paged_decode.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/limits.h"

namespace attention::cuda {
namespace {

constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxLength = int64_t{1} << 30;  // keeps i + diag + window in int32
constexpr double kWaveFill = 0.9;

}  // namespace

absl::StatusOr<PagedDecodePlan> PlanPagedDecode(const PagedDecodeParams& host,
                                                const DecodeExtent& extent,
                                                const PagedPlanOptions& options) {
  const KvShape& shape = host.shape;
  const int64_t dv = shape.value_head_dim();
  if (shape.head_dim > kPagedMaxHeadDim || dv > kPagedMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", shape.head_dim, " / v_head_dim ",
                                                   dv, ": the cuda KV pool takes head dims up to ",
                                                   kPagedMaxHeadDim));
  }
  PagedDecodePlan plan;
  plan.launch.num_seqs = static_cast<int>(host.num_seqs);
  const bool sixteen_bit = shape.dtype == DType::kFloat16 || shape.dtype == DType::kBFloat16;
  // The wide tile: its head dims exactly, no softcap, and room for its shared memory; V in K's
  // rows at QK 576 alone (MLA's latent cache).
  if (sixteen_bit && host.softcap == 0.0f && dv == kPagedWideVHeadDim &&
      std::find(std::begin(kPagedWideHeadDims), std::end(kPagedWideHeadDims), shape.head_dim) !=
          std::end(kPagedWideHeadDims) &&
      (!shape.v_from_k || shape.head_dim == 576) &&
      PagedWideSmemBytes(static_cast<int>(shape.head_dim), static_cast<int>(dv), shape.v_from_k) <=
          options.smem_per_block) {
    plan.launch.wide_head_dim = static_cast<int>(shape.head_dim);
    plan.launch.wide_v_from_k = shape.v_from_k;
  }
  const bool wide = plan.launch.wide_head_dim != 0;
  const int cta_rows = wide ? kPagedWideRows : 16;
  const int group = static_cast<int>(host.heads_q / shape.heads_kv);
  plan.m_blocks = static_cast<int>(
      std::max<int64_t>(1, (group * extent.max_seqlen_q + cta_rows - 1) / cta_rows));
  if (extent.max_seqlen_k >= kMaxLength || extent.max_seqlen_q >= kMaxLength ||
      host.num_seqs > kMaxGridYZ || shape.heads_kv * plan.m_blocks > kMaxGridYZ ||
      extent.page_rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the cuda KV pool takes fewer than 2^30 keys and queries per sequence, at most ",
        kMaxGridYZ, " sequences and ", kMaxGridYZ, " kv heads x 16-row blocks; got max_seqlen_k=",
        extent.max_seqlen_k, " max_seqlen_q=", extent.max_seqlen_q, " num_seqs=", host.num_seqs));
  }
  // The smallest tensor-core tile that holds head_dim, if any; with a softcap, the tile that has a
  // softcap instance (kPagedSoftcapHeadDim, which holds every head dim a tile does). The tiles
  // read V rows of D after K's: a V head dim of its own, or V in K's rows, runs on the SIMT kernel.
  if (sixteen_bit && !wide && shape.head_dim % 8 == 0 && dv == shape.head_dim && !shape.v_from_k) {
    plan.launch.kernel_head_dim = SpecialisationFor(kPagedTensorHeadDims, shape.head_dim);
    if (plan.launch.kernel_head_dim != 0 && host.softcap > 0.0f) {
      plan.launch.kernel_head_dim = kPagedSoftcapHeadDim;
      plan.launch.softcap = true;
    }
  }
  const bool tensor = plan.launch.kernel_head_dim != 0;
  plan.launch.simt_wide =
      !tensor && !wide && std::max(shape.head_dim, dv) > kPagedSimtNarrowHeadDim;
  // Key tiles of the tensor-core kernels (paged_decode_launch.cuh): 32 KiB of K+V per stage; the
  // wide tile's 32 keys (68 KiB at D = 576).
  plan.key_tile = options.key_tile > 0                ? options.key_tile
                  : wide                              ? 32
                  : !tensor                           ? 64
                  : plan.launch.kernel_head_dim == 64 ? 128
                                                      : 64;

  const int64_t tiles =
      std::max<int64_t>(1, (extent.max_seqlen_k + plan.key_tile - 1) / plan.key_tile);
  const int64_t base = std::max<int64_t>(1, shape.heads_kv * plan.m_blocks * host.num_seqs);
  const int64_t most = std::min<int64_t>(tiles, kPagedMaxSplits);
  // Splits of `want` requested: whole tiles per split, so possibly fewer in fact.
  auto actual = [&](int64_t want) {
    const int64_t tiles_per_split = (tiles + want - 1) / want;
    return (tiles + tiles_per_split - 1) / tiles_per_split;
  };
  int64_t splits = std::clamp<int64_t>(options.splits, 1, most);
  if (options.splits <= 0) {
    // The wide tile: one CTA per SM (its shared memory).
    const int64_t slots =
        int64_t{options.sm_count} * (options.ctas_per_sm > 0 ? options.ctas_per_sm
                                     : wide                  ? 1
                                            : PagedCtasPerSm(plan.launch.kernel_head_dim));
    auto fill = [&](int64_t s) {
      const int64_t ctas = base * actual(s);
      return static_cast<double>(ctas) / (((ctas + slots - 1) / slots) * slots);
    };
    double best = 0;
    for (int64_t s = 1; s <= most; ++s) best = std::max(best, fill(s));
    splits = 1;
    while (fill(splits) < kWaveFill * best) ++splits;
    if (wide) {
      // The wide tile's splits write partial o of up to 64 rows x Dv floats each (128 KiB at MLA's
      // Dv 512), which the last CTA of a row block reads alone: S splits cost that CTA S of those,
      // while each split reads max_seqlen_k / S keys of D + Dv halves. S stops where the merge's
      // reads pass four times a split's own, S^2 <= 2 NK (D + Dv) / (R Dv) (R the block's live
      // rows): at batch 1 over 4096 keys the fill alone gave MLA 64-128 splits, and the step took
      // 2.3-2.6x batch 8's time (an H100, 2026-12-06). D = 512's splits (8 live rows) stay as the
      // fill gives them at 4096 keys.
      const int64_t live_rows =
          std::min<int64_t>(cta_rows, int64_t{group} * std::max<int64_t>(1, extent.max_seqlen_q));
      const double cap_squared = 2.0 * static_cast<double>(extent.max_seqlen_k) *
                                 static_cast<double>(shape.head_dim + dv) /
                                 (static_cast<double>(live_rows) * static_cast<double>(dv));
      splits = std::clamp<int64_t>(static_cast<int64_t>(std::sqrt(cap_squared)), 1, splits);
    }
  }
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  plan.splits = static_cast<int>(actual(splits));
  plan.split_keys = static_cast<int>(tiles_per_split * plan.key_tile);
  plan.cluster =
      options.clusters && plan.splits > 1 && plan.splits <= kPagedMaxClusterSplits && tensor;
  if (plan.splits > 1 && !plan.cluster) {
    const size_t rows = static_cast<size_t>(host.heads_q * host.total_q);
    const size_t part_o = plan.splits * rows * dv * sizeof(float);
    plan.workspace_bytes = (part_o + 255) / 256 * 256 + plan.splits * rows * sizeof(float);
    plan.tickets = base;
  }
  return plan;
}

PagedKernelParams ToPagedKernelParams(const PagedDecodePlan& plan, const void* pool,
                                      int64_t page_bytes, const DecodeExtent& extent,
                                      const PagedDecodeParams& dev, void* workspace,
                                      int32_t* tickets) {
  PagedKernelParams k{};
  k.pool = static_cast<const unsigned char*>(pool);
  k.page_bytes = page_bytes;
  k.page_rows = static_cast<int>(extent.page_rows);
  k.q = dev.q;
  k.o = dev.o;
  k.lse = dev.lse;
  k.cu_seqlens_q = dev.cu_seqlens_q;
  k.seqlens_k = dev.seqlens_k;
  k.page_table = dev.page_table;
  k.page_table_stride = dev.page_table_stride;
  k.heads_q = static_cast<int>(dev.heads_q);
  k.heads_kv = static_cast<int>(dev.shape.heads_kv);
  k.group = static_cast<int>(dev.heads_q / dev.shape.heads_kv);
  k.head_dim = static_cast<int>(dev.shape.head_dim);
  k.v_head_dim = static_cast<int>(dev.shape.value_head_dim());
  k.v_from_k = dev.shape.v_from_k;
  const Log2Scale scale = ToLog2Scale(dev.softmax_scale);
  k.scale_log2 = scale.scale_log2;
  k.negate_q = scale.negate_q;
  k.window_left = ClampWindow(dev.window_left, extent.max_seqlen_k);
  k.window_right = ClampWindow(dev.window_right, extent.max_seqlen_q);
  k.sinks = dev.sinks;
  if (dev.softcap > 0.0f) {
    k.softcap_log2 = dev.softcap * kLog2e;
    k.softcap_scale = std::fabs(dev.softmax_scale) / dev.softcap;  // q.k to s / softcap
  }
  k.chunk_size = static_cast<int>(std::min(dev.chunk_size, kMaxLength));
  k.m_blocks = plan.m_blocks;
  k.splits = plan.splits;
  k.split_keys = plan.split_keys;
  k.total_rows = dev.heads_q * dev.total_q;
  k.cluster = plan.cluster;
  if (plan.splits > 1 && !plan.cluster) {
    const size_t part_o = plan.splits * k.total_rows * k.v_head_dim * sizeof(float);
    k.part_o = static_cast<float*>(workspace);
    k.part_lse =
        reinterpret_cast<float*>(static_cast<char*>(workspace) + (part_o + 255) / 256 * 256);
    k.tickets = tickets;
  }
  return k;
}

absl::Status LaunchPagedDecode(const PagedDecodePlan& plan, const void* pool, int64_t page_bytes,
                               const DecodeExtent& extent, const PagedDecodeParams& dev,
                               void* workspace, int32_t* tickets, cudaStream_t stream) {
  if (dev.num_seqs == 0 || dev.total_q == 0) return absl::OkStatus();
  const PagedKernelParams k =
      ToPagedKernelParams(plan, pool, page_bytes, extent, dev, workspace, tickets);
  cudaError_t err = cudaSuccess;
  switch (dev.shape.dtype) {
    case DType::kFloat16:
      err = LaunchPagedDecodeF16(k, plan.launch, stream);
      break;
    case DType::kBFloat16:
      err = LaunchPagedDecodeBF16(k, plan.launch, stream);
      break;
    case DType::kFloat32:
      err = LaunchPagedDecodeF32(k, plan.launch, stream);
      break;
    case DType::kFloat8E4M3:  // sessions refuse float8 (server/requests/session_request.cc)
      return absl::UnimplementedError("paged decode of float8_e4m3 rows is not implemented");
  }
  return CudaStatus(err, "paged decode kernels");
}

}  // namespace attention::cuda
