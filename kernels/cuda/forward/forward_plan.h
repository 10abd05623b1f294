// The forward pass's plan: which kernel variant runs a call on a device, chosen from the device's
// capabilities (queried once per device) or forced by the caller (tests, the bench), before any
// launch. A variant is one ForwardVariant value (its name in ForwardVariantName, its place in
// kForwardVariants), one launcher (LaunchVariant in cuda_attention.cc) and one planning rule
// (PlanVariant in forward_plan.cc); wgmma_sm90 was added beside mma_sm80 that way. The decode
// path's counterpart is PlanPagedDecode (decode/paged_decode.h); the host runner's own launch
// decisions are PlanLaunch (runtime/launch_plan.h).
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/ops/device_caps.h"

namespace attention::cuda {

// The forward kernels.
enum class ForwardVariant {
  // "wgmma_sm90": TMA, wgmma and producer/consumer warpgroups (flash_forward_sm90_kernel.cuh),
  // float16 and bfloat16, and float8 e4m3 on dense calls at head dims 128 and 256 (others are
  // dequantised to bfloat16 first). Compute capability 9.0 exactly (sm_90a code).
  kWgmmaSm90,
  // "mma_sm80": FlashAttention-2 on mma.sync m16n8k16 (float16, bfloat16) and 3xTF32 m16n8k8
  // (float32) with cp.async double buffering (flash_forward_kernel.cuh). Compute capability >= 8.0.
  kMmaSm80,
};

// Every variant, in the planner's order of preference: unforced, the first that can run is chosen.
inline constexpr ForwardVariant kForwardVariants[] = {ForwardVariant::kWgmmaSm90,
                                                      ForwardVariant::kMmaSm80};

// The variant's name ([a-z0-9_], usable in test names, flags and JSON), e.g. "mma_sm80"; "unknown"
// for a value outside the enum.
absl::string_view ForwardVariantName(ForwardVariant variant);
// The variant named `name` (ForwardVariantName), or INVALID_ARGUMENT listing the names.
absl::StatusOr<ForwardVariant> ParseForwardVariant(absl::string_view name);

// Whether this build holds the wgmma_sm90 kernel (CUDA architectures with 90a; its body is
// sm_90a code only, empty in any other).
bool WgmmaSm90InBuild();

struct ForwardPlan {
  ForwardVariant variant = ForwardVariant::kMmaSm80;
  DType dtype = DType::kFloat32;
  int kernel_head_dim = 0;  // the specialised head dim that runs (kSpecialisedHeadDims)
  int smem_bytes = 0;       // dynamic shared memory per CTA
  // Device memory the launch needs beside the call's tensors (LaunchForward's workspace): float8
  // V transposed on wgmma_sm90; 0 otherwise.
  int64_t workspace_bytes = 0;
};

// Plans a forward pass of p (its dtype and head dim; checked by ToKernelParams) on a device with
// `caps`: the forced variant, or the first of kForwardVariants that can run it (so on Hopper
// float16, bfloat16 and float8 at head dims 128 and 256 run on wgmma_sm90, float32 falls back to
// mma_sm80). Errors name the variant and the reason: INVALID_ARGUMENT for an unknown variant or
// params the variant does not take (HostRunner dequantises float8 that none takes), and
// FAILED_PRECONDITION for a device it cannot run on; unforced, when no variant can run it, every
// variant's reason with the last one's code. Makes no CUDA call.
absl::StatusOr<ForwardPlan> PlanFlashForward(const AttentionParams& p, const DeviceCaps& caps,
                                             std::optional<ForwardVariant> forced = std::nullopt);

}  // namespace attention::cuda
