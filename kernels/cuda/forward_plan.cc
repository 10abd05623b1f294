#include "kernels/cuda/forward_plan.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/limits.h"

namespace attention::cuda {
namespace {

// mma.sync m16n8k16 with bfloat16, cp.async and ldmatrix: sm_80 and later (the build's sm_80 code,
// or its PTX compiled for a newer GPU).
constexpr int kMmaSm80MinCapability = 80;

std::string CapabilityString(int compute_capability) {
  return absl::StrCat(compute_capability / 10, ".", compute_capability % 10);
}

absl::StatusOr<ForwardPlan> PlanMmaSm80(const AttentionParams& p, const DeviceCaps& caps) {
  const absl::string_view name = ForwardVariantName(ForwardVariant::kMmaSm80);
  if (caps.compute_capability < kMmaSm80MinCapability) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward variant ", name, " needs compute capability ",
                     CapabilityString(kMmaSm80MinCapability), " or later; the device has ",
                     CapabilityString(caps.compute_capability)));
  }
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward variant ", name, " takes head dims that are multiples of 8 up to ",
                     kMaxHeadDim, "; got ", p.head_dim));
  }
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

// The planning rule of each variant: its plan for p on caps, or why it cannot run it.
absl::StatusOr<ForwardPlan> PlanVariant(ForwardVariant variant, const AttentionParams& p,
                                        const DeviceCaps& caps) {
  switch (variant) {
    case ForwardVariant::kMmaSm80:
      return PlanMmaSm80(p, caps);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown forward variant ", static_cast<int>(variant)));
}

}  // namespace

absl::string_view ForwardVariantName(ForwardVariant variant) {
  switch (variant) {
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
  absl::Status first_error;
  for (ForwardVariant v : kForwardVariants) {
    absl::StatusOr<ForwardPlan> plan = PlanVariant(v, p, caps);
    if (plan.ok()) return plan;
    if (first_error.ok()) first_error = plan.status();
  }
  // No variant can run it: the reason of the preferred one.
  return first_error;
}

}  // namespace attention::cuda
