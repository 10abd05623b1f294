// attention::cuda::Forward: checks what the kernels rely on (head dim, 16-byte alignment, sizes
// that fit the grid), converts AttentionParams into KernelParams (ToKernelParams), plans the kernel
// variant (PlanFlashForward) and launches it for the dtype.
#include "kernels/cuda/forward/cuda_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/forward/launchers.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {

// Sequences with chunks are shorter than this, so that chunk bounds fit int32 (masks.cuh).
constexpr int64_t kMaxChunkedLength = int64_t{1} << 30;

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// ForwardVariant::kMmaSm80: the mma.sync kernel of the dtype (launchers.h).
cudaError_t LaunchMmaSm80(DType dtype, const KernelParams& k, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return LaunchFlashForwardF16(k, stream);
    case DType::kBFloat16:
      return LaunchFlashForwardBF16(k, stream);
    case DType::kFloat32:
      return LaunchForwardF32(k, stream);
    case DType::kFloat8E4M3:
      break;  // not reached: the plan refuses float8 (HostRunner dequantises it first)
  }
  return cudaErrorInvalidValue;
}

// ForwardVariant::kWgmmaSm90: the Hopper kernel of the dtype.
cudaError_t LaunchWgmmaSm90(DType dtype, const KernelParams& k, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return LaunchFlashForwardSm90F16(k, stream);
    case DType::kBFloat16:
      return LaunchFlashForwardSm90BF16(k, stream);
    case DType::kFloat8E4M3:
      return LaunchFlashForwardSm90F8(k, stream);
    case DType::kFloat32:
      break;  // not reached: the plan sends it to mma_sm80
  }
  return cudaErrorInvalidValue;
}

// The launcher of each variant.
cudaError_t LaunchVariant(const ForwardPlan& plan, const KernelParams& k, cudaStream_t stream) {
  switch (plan.variant) {
    case ForwardVariant::kWgmmaSm90:
      return LaunchWgmmaSm90(plan.dtype, k, stream);
    case ForwardVariant::kMmaSm80:
      return LaunchMmaSm80(plan.dtype, k, stream);
  }
  return cudaErrorInvalidValue;  // not reached: plans name known variants
}

}  // namespace

absl::Status RefuseUnservedOptions(const AttentionParams& p) {
  AttentionParams unserved = p;
  unserved.sinks = nullptr;
  unserved.softcap = 0.0f;
  unserved.chunk_size = 0;
  return RefuseOpenModelOptions(unserved, "cuda");
}

absl::StatusOr<KernelParams> ToKernelParams(const AttentionParams& p) {
  RETURN_IF_ERROR(CheckParams(p));
  RETURN_IF_ERROR(RefuseUnservedOptions(p));
  if (p.head_dim % 8 != 0 || p.head_dim > kMaxHeadDim) {
    return absl::UnimplementedError(
        absl::StrCat("head_dim ", p.head_dim,
                     " is not implemented by the cuda backend (it takes "
                     "multiples of 8 up to ",
                     kMaxHeadDim, ")"));
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  if (p.seqlen_q > kMaxInt || p.seqlen_k > kMaxInt || p.total_q > kMaxInt || p.total_k > kMaxInt ||
      p.heads_q > kMaxForwardHeads || p.batch > kMaxForwardHeads) {
    return absl::UnimplementedError(absl::StrCat(
        "the cuda backend takes at most ", kMaxForwardHeads,
        " heads and batch items and 2^31-1 rows; "
        "got batch=",
        p.batch, " heads_q=", p.heads_q, " seqlen_q=", p.seqlen_q, " seqlen_k=", p.seqlen_k));
  }
  if (p.chunk_size > 0 && (p.seqlen_q >= kMaxChunkedLength || p.seqlen_k >= kMaxChunkedLength)) {
    return absl::UnimplementedError(absl::StrCat(
        "chunk_size: the cuda backend takes chunked attention on sequences of fewer than 2^30 "
        "rows; got seqlen_q=",
        p.seqlen_q, " seqlen_k=", p.seqlen_k));
  }
  // 16-byte cp.async and vector stores: every row, head and batch start must be 16-byte aligned
  // (true for contiguous tensors with head_dim % 8 == 0 from cudaMalloc).
  const int64_t elems16 = 16 / static_cast<int64_t>(DTypeSize(p.dtype));
  const int64_t strides[] = {p.q_batch_stride, p.q_head_stride,  p.q_row_stride,   p.k_batch_stride,
                             p.k_head_stride,  p.k_row_stride,   p.v_batch_stride, p.v_head_stride,
                             p.v_row_stride,   p.o_batch_stride, p.o_head_stride,  p.o_row_stride};
  bool aligned = Aligned16(p.q) && Aligned16(p.k) && Aligned16(p.v) && Aligned16(p.o);
  for (int64_t s : strides) aligned = aligned && s % elems16 == 0;
  if (!aligned) {
    return absl::UnimplementedError(
        "tensors whose base pointers or strides are not 16-byte aligned are not implemented by "
        "the cuda backend");
  }

  KernelParams k{};
  k.q = p.q;
  k.k = p.k;
  k.v = p.v;
  k.o = p.o;
  k.lse = p.lse;
  k.q_batch_stride = p.q_batch_stride;
  k.q_head_stride = p.q_head_stride;
  k.q_row_stride = p.q_row_stride;
  k.k_batch_stride = p.k_batch_stride;
  k.k_head_stride = p.k_head_stride;
  k.k_row_stride = p.k_row_stride;
  k.v_batch_stride = p.v_batch_stride;
  k.v_head_stride = p.v_head_stride;
  k.v_row_stride = p.v_row_stride;
  k.o_batch_stride = p.o_batch_stride;
  k.o_head_stride = p.o_head_stride;
  k.o_row_stride = p.o_row_stride;
  k.lse_batch_stride = p.lse_batch_stride;
  k.lse_head_stride = p.lse_head_stride;
  k.batch = static_cast<int>(p.batch);
  k.heads_q = static_cast<int>(p.heads_q);
  k.seqlen_q = static_cast<int>(p.seqlen_q);
  k.seqlen_k = static_cast<int>(p.seqlen_k);
  k.total_q = static_cast<int>(p.is_varlen() ? p.total_q : p.seqlen_q);
  k.total_k = static_cast<int>(p.is_varlen() ? p.total_k : p.seqlen_k);
  k.kv_group = static_cast<int>(p.heads_q / p.heads_kv);
  k.head_dim = static_cast<int>(p.head_dim);
  // The descales fold in as float32 factors: q_descale * k_descale into the logits'
  // scale, v_descale into o's normalisation (kernel_params.h).
  const Log2Scale scale = ToLog2Scale(EffectiveSoftmaxScale(p));
  k.scale_log2 = scale.scale_log2;
  k.negate_q = scale.negate_q;
  k.o_scale = p.v_descale;
  k.mask_top_left = p.mask_alignment == MaskAlignment::kTopLeft;
  k.window_left = ClampWindow(p.window_left, k.mask_top_left ? p.seqlen_q : p.seqlen_k);
  k.window_right = ClampWindow(p.window_right, k.mask_top_left ? p.seqlen_k : p.seqlen_q);
  k.cu_seqlens_q = p.cu_seqlens_q;
  k.cu_seqlens_k = p.cu_seqlens_k;
  // Options (kernel_params.h). The capped logits are in the log2 domain already: the softmax
  // takes them at scale 1. sinks stay null here: LaunchForward copies them to the device.
  if (p.softcap > 0.0f) {
    k.softcap_log2 = p.softcap * kLog2e;
    k.softcap_scale = std::fabs(EffectiveSoftmaxScale(p)) / p.softcap;  // q.k to s / softcap
    k.scale_log2 = 1.0f;
  }
  // Keys and diagonal keys lie in (-2^30, 2^30) (the lengths' bound with chunks, above), where any
  // chunk of 2^30 keys or more has its one boundary at key 0: such chunks run as 2^30, which keeps
  // every chunk bound in int32 (masks.cuh).
  k.chunk_size = static_cast<int>(std::min(p.chunk_size, kMaxChunkedLength));
  return k;
}

absl::StatusOr<ForwardLaunch> PrepareForward(const AttentionParams& p,
                                             std::optional<ForwardVariant> variant) {
  ASSIGN_OR_RETURN(const KernelParams k, ToKernelParams(p));
  ASSIGN_OR_RETURN(const DeviceCaps caps, CurrentDeviceCaps());
  ASSIGN_OR_RETURN(const ForwardPlan plan, PlanFlashForward(p, caps, variant));
  return ForwardLaunch{k, plan, p.sinks};
}

absl::StatusOr<ForwardScratch> AllocateForwardScratch() {
  ForwardScratch scratch;
  constexpr size_t kBytes = 2 * sizeof(int32_t);
  absl::Status status =
      CudaStatus(cudaMalloc(reinterpret_cast<void**>(&scratch.tile_counters), kBytes),
                 "allocate the forward kernel's tile counters");
  if (status.ok()) {
    status = CudaStatus(cudaMemset(scratch.tile_counters, 0, kBytes), "zero the tile counters");
  }
  if (status.ok()) {
    status = CudaStatus(
        cudaMalloc(reinterpret_cast<void**>(&scratch.sinks), kMaxForwardHeads * sizeof(float)),
        "allocate the forward kernel's sinks");
  }
  if (!status.ok()) {
    FreeForwardScratch(scratch);
    return status;
  }
  return scratch;
}

void FreeForwardScratch(ForwardScratch& scratch) {
  if (scratch.tile_counters != nullptr) cudaFree(scratch.tile_counters);
  if (scratch.sinks != nullptr) cudaFree(scratch.sinks);
  scratch = ForwardScratch{};
}

absl::Status LaunchForward(const ForwardLaunch& launch, cudaStream_t stream,
                           const ForwardScratch& scratch, void* workspace) {
  KernelParams params = launch.params;
  params.tile_counters = scratch.tile_counters;
  params.v_transposed = workspace;
  if (launch.plan.variant == ForwardVariant::kWgmmaSm90 && params.tile_counters == nullptr) {
    return absl::InternalError(
        "forward kernel wgmma_sm90 launched without a ForwardScratch (tile counters)");
  }
  if (launch.sinks != nullptr) {
    if (scratch.sinks == nullptr) {
      return absl::InternalError("forward kernel launched with sinks without a ForwardScratch");
    }
    // Host memory, [Hq] floats. The copy runs before the kernel in stream order, after any
    // earlier launch on this stream that read the array. Pageable memory is read (into the
    // driver's staging) before the call returns; pinned memory only when the stream reaches the
    // copy, so the caller keeps it until then (HostRunner waits for its stream before it returns).
    // One small DMA per launch: a fixed cost of a few microseconds, the only one sinks add
    // outside the epilogue's AddSink.
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(scratch.sinks, launch.sinks, params.heads_q * sizeof(float),
                                   cudaMemcpyHostToDevice, stream),
                   "copy the sinks to the device"));
    params.sinks = scratch.sinks;
  }
  if (launch.plan.workspace_bytes > 0 && workspace == nullptr) {
    return absl::InternalError(absl::StrCat("forward kernel ",
                                            ForwardVariantName(launch.plan.variant), " needs ",
                                            launch.plan.workspace_bytes, " bytes of workspace"));
  }
  if (const cudaError_t err = LaunchVariant(launch.plan, params, stream); err != cudaSuccess) {
    return CudaError(err, absl::StrCat("forward kernel ", ForwardVariantName(launch.plan.variant)));
  }
  return absl::OkStatus();
}

absl::Status Forward(const AttentionParams& p, cudaStream_t stream, const ForwardScratch& scratch,
                     std::optional<ForwardVariant> variant) {
  ASSIGN_OR_RETURN(const ForwardLaunch launch, PrepareForward(p, variant));
  if (launch.plan.workspace_bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "forward kernel ", ForwardVariantName(launch.plan.variant), " needs ",
        launch.plan.workspace_bytes,
        " bytes of workspace for this call (float8 V transposed): use PrepareForward and "
        "LaunchForward with a workspace"));
  }
  return LaunchForward(launch, stream, scratch, nullptr);
}

}  // namespace attention::cuda
