#include "kernels/cuda/forward/forward_plan.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/forward/launchers.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/prep/dequantise.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {

// mma.sync m16n8k16 with bfloat16, cp.async and ldmatrix: sm_80 and later (the build's sm_80 code,
// or its PTX compiled for a newer GPU).
constexpr int kMmaSm80MinCapability = 80;

std::string CapabilityString(int compute_capability) {
  return absl::StrCat(compute_capability / 10, ".", compute_capability % 10);
}

// Both variants take head dims that are multiples of 8 up to kMaxHeadDim (specialised for
// kSpecialisedHeadDims, smaller ones zero-filled).
absl::Status CheckHeadDim(absl::string_view name, const AttentionParams& p) {
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward variant ", name, " takes head dims that are multiples of 8 up to ",
                     kMaxHeadDim, "; got ", p.head_dim));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardPlan> PlanMmaSm80(const AttentionParams& p, const DeviceCaps& caps) {
  const absl::string_view name = ForwardVariantName(ForwardVariant::kMmaSm80);
  if (caps.compute_capability < kMmaSm80MinCapability) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward variant ", name, " needs compute capability ",
                     CapabilityString(kMmaSm80MinCapability), " or later; the device has ",
                     CapabilityString(caps.compute_capability)));
  }
  RETURN_IF_ERROR(CheckHeadDim(name, p));
  ForwardPlan plan{.variant = ForwardVariant::kMmaSm80,
                   .dtype = p.dtype,
                   .kernel_head_dim = SpecialisationFor(kSpecialisedHeadDims, p.head_dim)};
  const int head_dim = static_cast<int>(p.head_dim);
  switch (p.dtype) {
    case DType::kFloat16:
      plan.smem_bytes = FlashForwardSmemBytesF16(head_dim);
      break;
    case DType::kBFloat16:
      plan.smem_bytes = FlashForwardSmemBytesBF16(head_dim);
      break;
    case DType::kFloat32:
      plan.smem_bytes = FlashForwardSmemBytesF32(head_dim);
      break;
    case DType::kFloat8E4M3:
      return absl::InvalidArgumentError(absl::StrCat(
          "forward variant ", name,
          " takes float32, float16 and bfloat16; float8_e4m3 inputs are dequantised to bfloat16 "
          "before it (HostRunner)"));
  }
  if (plan.smem_bytes > caps.smem_per_block_optin) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward variant ", name, " needs ", plan.smem_bytes,
                     " bytes of shared memory per block for ", DTypeName(p.dtype), " at head_dim ",
                     p.head_dim, "; the device allows ", caps.smem_per_block_optin));
  }
  return plan;
}

// wgmma, setmaxnreg and TMA as built (sm_90a): compute capability 9.0 and nothing else.
constexpr int kWgmmaSm90Capability = 90;

absl::StatusOr<ForwardPlan> PlanWgmmaSm90(const AttentionParams& p, const DeviceCaps& caps) {
  const absl::string_view name = ForwardVariantName(ForwardVariant::kWgmmaSm90);
  if (!WgmmaSm90InBuild()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "forward variant ", name,
        " is not in this build (its CUDA architectures make no sm_90a code; build with 90a)"));
  }
  if (caps.compute_capability != kWgmmaSm90Capability) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward variant ", name, " needs compute capability ",
                     CapabilityString(kWgmmaSm90Capability), " (sm_90a code); the device has ",
                     CapabilityString(caps.compute_capability)));
  }
  if (p.dtype == DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "forward variant ", name, " takes float16, bfloat16 and float8_e4m3; got float32"));
  }
  RETURN_IF_ERROR(CheckHeadDim(name, p));
  const int head_dim = static_cast<int>(p.head_dim);
  ForwardPlan plan{.variant = ForwardVariant::kWgmmaSm90,
                   .dtype = p.dtype,
                   .kernel_head_dim = SpecialisationFor(kSpecialisedHeadDims, p.head_dim),
                   .smem_bytes = FlashForwardSm90SmemBytes(head_dim)};
  if (p.dtype == DType::kFloat8E4M3) {
    // e4m3 rows of 16-byte multiples (TMA), the 128-byte swizzled rows of D 128 and 256, and V^T
    // per batch item (one map over dense items; varlen would need per-item padding).
    if (p.is_varlen() || head_dim % 16 != 0 || plan.kernel_head_dim < 128) {
      return absl::InvalidArgumentError(absl::StrCat(
          "forward variant ", name,
          " takes float8_e4m3 on dense calls at head dims that are multiples of 16 above 64; got ",
          p.is_varlen() ? "a varlen call" : "a dense call", " at head_dim ", p.head_dim,
          " (HostRunner dequantises such calls to bfloat16)"));
    }
    // The options instances are 16-bit only (flash_forward_sm90_launch.cuh).
    if (p.has_open_model_options()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "forward variant ", name, " takes float8_e4m3 without open-model options; got ",
          OpenModelOptionNames(p), " (HostRunner dequantises such calls to bfloat16)"));
    }
    plan.smem_bytes = FlashForwardSm90F8SmemBytes(head_dim);
    plan.workspace_bytes = TransposedVBytes(p.batch, p.heads_kv, p.head_dim, p.seqlen_k);
  }
  if (plan.smem_bytes > caps.smem_per_block_optin) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward variant ", name, " needs ", plan.smem_bytes,
                     " bytes of shared memory per block at head_dim ", p.head_dim,
                     "; the device allows ", caps.smem_per_block_optin));
  }
  return plan;
}

// The planning rule of each variant: its plan for p on caps, or why it cannot run it.
absl::StatusOr<ForwardPlan> PlanVariant(ForwardVariant variant, const AttentionParams& p,
                                        const DeviceCaps& caps) {
  switch (variant) {
    case ForwardVariant::kWgmmaSm90:
      return PlanWgmmaSm90(p, caps);
    case ForwardVariant::kMmaSm80:
      return PlanMmaSm80(p, caps);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown forward variant ", static_cast<int>(variant)));
}

}  // namespace

bool WgmmaSm90InBuild() {
#if defined(ATTENTION_BUILT_SM90A)
  return true;
#else
  return false;
#endif
}

absl::string_view ForwardVariantName(ForwardVariant variant) {
  switch (variant) {
    case ForwardVariant::kWgmmaSm90:
      return "wgmma_sm90";
    case ForwardVariant::kMmaSm80:
      return "mma_sm80";
  }
  return "unknown";
}

absl::StatusOr<ForwardVariant> ParseForwardVariant(absl::string_view name) {
  for (ForwardVariant v : kForwardVariants) {
    if (ForwardVariantName(v) == name) return v;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown forward variant \"", name, "\"; the variants are ",
                   absl::StrJoin(kForwardVariants, ", ", [](std::string* out, ForwardVariant v) {
                     absl::StrAppend(out, ForwardVariantName(v));
                   })));
}

absl::StatusOr<ForwardPlan> PlanFlashForward(const AttentionParams& p, const DeviceCaps& caps,
                                             std::optional<ForwardVariant> forced) {
  if (forced.has_value()) return PlanVariant(*forced, p, caps);
  std::string reasons;
  absl::StatusCode code = absl::StatusCode::kInternal;
  for (ForwardVariant v : kForwardVariants) {
    absl::StatusOr<ForwardPlan> plan = PlanVariant(v, p, caps);
    if (plan.ok()) return plan;
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", plan.status().message());
    code = plan.status().code();
  }
  // No variant can run it: every variant's reason, with the code of the last (the most general).
  return absl::Status(code, reasons);
}

}  // namespace attention::cuda
