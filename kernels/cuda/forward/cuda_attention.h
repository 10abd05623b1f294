// The CUDA backend's forward pass: checks, converts, plans (forward_plan.h: which kernel variant,
// from the current device's caps or forced) and launches. See flash_forward_sm90_kernel.cuh
// (Hopper) and flash_forward_kernel.cuh (the mma.sync kernel) for the kernels, their tiles and
// measured speed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/forward/forward_plan.h"
#include "kernels/cuda/ops/kernel_params.h"

namespace attention::cuda {

// The most query heads (and batch items) a forward launch takes: CUDA's limit on gridDim.y and z.
inline constexpr int64_t kMaxForwardHeads = 65535;

// Device memory that the forward launches on one stream share (they run one after another): the
// wgmma kernel's tile-scheduler counters, zero between launches (each launch leaves them zero),
// and the sink logits of a call with sinks (copied in by LaunchForward, in stream order). One per
// stream; default-constructed (null) it serves no launch that needs it.
struct ForwardScratch {
  int32_t* tile_counters = nullptr;  // 2 entries
  float* sinks = nullptr;            // kMaxForwardHeads entries
};
// A zeroed ForwardScratch on the current device (waits for the zeroing), or the CUDA error.
absl::StatusOr<ForwardScratch> AllocateForwardScratch();
// Frees what AllocateForwardScratch allocated (the device it was allocated on must be current,
// and no launch using it may still run); null members are skipped.
void FreeForwardScratch(ForwardScratch& scratch);

// Enqueues attention on `stream` on the current device. q, k, v, o, lse and cu_seqlens_* are
// device pointers; sinks (if any) host memory, as AttentionParams has it. Open-model options:
// sinks, softcap and chunk_size are served (the kernels' options instances); a V head dim of its
// own is refused by name (RefuseUnservedOptions). Returns at once; the result is ready when the
// stream reaches this point. Every CUDA error becomes a Status naming it. variant: run this kernel
// variant instead of the planner's choice (tests, benchmarks), or fail saying why it cannot run. An
// Inf or NaN in V at a key the mask hides from some rows reaches those rows here (the tensor-core P
// V multiplies their P = 0 by it); HostRunner sends such calls to the exact CPU kernel instead
// (host_runner.h). `scratch` is this stream's (ForwardScratch). Calls whose plan needs a workspace
// (float8 on wgmma_sm90) get INVALID_ARGUMENT here: they go through PrepareForward and
// LaunchForward.
absl::Status Forward(const AttentionParams& p, cudaStream_t stream, const ForwardScratch& scratch,
                     std::optional<ForwardVariant> variant = std::nullopt);

// A checked, converted and planned forward pass, ready to launch.
struct ForwardLaunch {
  KernelParams params;
  ForwardPlan plan;
  // Host float32 [Hq] sink logits (AttentionParams::sinks), copied into the scratch's device
  // array by LaunchForward, which points params.sinks there; nullptr: none.
  const float* sinks = nullptr;
};
// Everything Forward does before it launches (no device work; the current device's caps are
// queried once per device): the launch, or the error Forward would return.
absl::StatusOr<ForwardLaunch> PrepareForward(const AttentionParams& p,
                                             std::optional<ForwardVariant> variant = std::nullopt);
// Enqueues a prepared launch on `stream` (the device it was prepared on must be current).
// `workspace`: device memory of at least launch.plan.workspace_bytes that no other work uses
// until the launch has run (nullptr when that is 0).
absl::Status LaunchForward(const ForwardLaunch& launch, cudaStream_t stream,
                           const ForwardScratch& scratch, void* workspace);

// OK when the forward kernels serve every open-model option p sets (sinks, softcap, chunk_size),
// else UNIMPLEMENTED naming the others (v_head_dim) and the cuda backend.
absl::Status RefuseUnservedOptions(const AttentionParams& p);

// The checks and the conversion Forward does before it launches: the kernels' view of `p`, or the
// error Forward would return. (The tile sweep in bench/cuda launches other tiles with it.)
absl::StatusOr<KernelParams> ToKernelParams(const AttentionParams& p);

}  // namespace attention::cuda
