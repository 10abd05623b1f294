// Runs the CUDA backend on host tensors: one device, a pool of CUDA streams, and per stream a
// pinned host staging buffer and a device buffer that are reused across calls. A call takes a
// free stream, copies q, k, v (and cu_seqlens) to its device buffer, runs Forward, copies o (and
// lse) back, and times each stage with CUDA events; calls on different streams overlap (one
// stream's copies beside another's kernel). The server's CUDA executor, the GPU tests and the
// pipeline benchmark share it.
//
// Several compatible requests (CanShareLaunch) run as one launch (RunBatch): requests of equal
// shapes are concatenated along B; BSHD and varlen requests of different lengths are packed as
// varlen [total, H, D] with cu_seqlens built here. Results go back to each request's own o and lse.
//
// Host copies per call, for each input tensor: host memory -> pinned staging (one memcpy, split
// over 4 threads above 8 MiB: one thread copies at 5-6 GB/s on the H200 host) -> DMA; for o and
// lse: DMA -> pinned staging -> host memory (one memcpy). Consecutive staged items of a batch go
// in one DMA. A tensor whose host memory is already pinned (cudaHostAlloc or cudaHostRegister)
// skips its staging memcpy and is DMA'd directly (0 host copies); so does q, k, v, o or lse in
// this device's own memory (a client's CUDA IPC region), copied device to device, and a lone dense
// request with q, k, v and o there (each on 16 bytes, D a multiple of 8) is read and written in
// place, no copy (its lse too when it is there; then h2d_us and d2h_us are 0). Registering pageable
// memory per call (cudaHostRegister) would remove the memcpy too, but pins page by page and costs
// more than the memcpy it saves.
//
// Memory: the device buffers of all streams together stay within options.memory_budget_bytes. A
// call needing more than the whole budget is refused (RESOURCE_EXHAUSTED, needed vs budget bytes)
// before anything is allocated; a call needing more than its stream holds grows that stream's
// buffer to the new high-water mark, first freeing idle streams' buffers and then waiting for busy
// ones when the budget is short. After warm-up (every stream grown to the largest call) nothing is
// allocated on the call path.
//
// Errors: a CUDA error fails only the call that met it (cuda_status.h: RESOURCE_EXHAUSTED when an
// allocation failed, else INTERNAL, naming the error); the stream is drained and reused. Errors
// that poison the whole CUDA context (an illegal address in a kernel) fail every later call on the
// device too; nothing short of a new process recovers from those.
//
// What falls back: a masked request (causal, a window or chunks) whose V holds an Inf or NaN is
// computed on the CPU (cpu::CpuBackend, the exact kernel) instead of the GPU and its result
// returned as this backend's; the rest of its batch still runs on the GPU. Such inputs are
// pathological (a poisoned tensor), and the tensor-core kernel cannot compute them exactly: its P V
// multiplies a masked key's P = 0 by V (0 * NaN = NaN) for every row of a tile, while the reference
// keeps a key a row cannot see out of that row. So they are slower here but exact. Before each
// masked call the runner scans V's exponent bits where V is: on the host (HoldsNonFinite,
// kernels/non_finite.h: ~2.5-3 ms for a 64 MiB bfloat16 V on one core of the dev machine), or, for
// V in this device's memory, on the device with the same bit test
// (kernels/cuda/prep/non_finite_scan.h), so a request from device memory takes the path the same
// request from the host takes. One that falls back copies its device tensors to host buffers, runs
// the CPU kernel on them and copies o and lse back: the same bytes in, the same answer out, bit for
// bit. Unmasked calls skip the scan (their only unseen keys, past Nk, are zero-filled on the
// device). The times of a fallen-back call count the CPU run (and its copies) as compute_us.
//
// float8 e4m3 inputs are served as the forward plan decides (PlanFlashForward): dense calls at head
// dims 128 and 256 on a Hopper GPU (an sm_90a build) run on the wgmma_sm90 kernel's own e4m3 path,
// which reads q and k as they come and V transposed into the launch's workspace
// (prep/dequantise.h, LaunchTransposeE4m3V); every other float8 call is served by conversion: q,
// k and v are copied to the device as they come (1 byte an element), dequantised there into
// bfloat16 copies (exact), and the bfloat16 kernel runs on those. Either way the descales are
// folded into the kernel's logit scale and output normalisation, and o comes out in bfloat16.
//
// Every decision above (packing, in place or copied, staged or direct, lse's way back, where V is
// scanned) is made by PlanLaunch and PlanVScan (launch_plan.h), pure functions tested without a
// GPU; RunOn carries the plan out.
//
// Head dims that are not a multiple of 8 are served by padding: each D-element line of q, k, v
// lands in a zeroed line of D8 = roundup(D, 8) elements (cudaMemcpy2D), the kernel runs with
// head dim D8 (zero columns add nothing to q.k; the scale stays the caller's), and o's first D
// columns are copied back.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/forward/forward_plan.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/runtime/launch_plan.h"

namespace attention::cpu {
class CpuBackend;
}  // namespace attention::cpu

namespace attention::cuda {

struct HostRunnerOptions {
  int device = 0;
  // Calls in flight at once, each on its own stream with its own buffers.
  int streams = 1;
  // Device bytes all streams' buffers may hold together; 0: no limit but the device's memory.
  int64_t memory_budget_bytes = 0;
  // Fill o and lse with NaN on the device before the kernel, so unwritten elements show (tests).
  bool poison_outputs = false;
  // Run every call on this forward kernel variant instead of the planner's choice (tests, the
  // bench); a call it cannot run fails with the reason (PlanFlashForward).
  std::optional<ForwardVariant> forward_variant;
};

struct HostRunTimes {
  double h2d_us = 0, compute_us = 0, d2h_us = 0;
};

// How RunBatch(items) serves float8 e4m3 on a device with `caps` (Float8Path{} for other
// dtypes): the forward plan's kernel reads e4m3 itself, with its workspace (wgmma_sm90: dense
// calls at head dims 128 and 256), or, where the plan's variant takes no float8 for the launch
// (INVALID_ARGUMENT), q, k and v are dequantised to bfloat16 first. Other plan errors are returned.
// Pure (no CUDA call), so tested with hand-made caps (cuda_plan_tests).
absl::StatusOr<Float8Path> PlanFloat8(absl::Span<const AttentionParams> items,
                                      const DeviceCaps& caps,
                                      std::optional<ForwardVariant> variant = std::nullopt);

class HostRunner {
 public:
  // Creates the streams and events on options.device; buffers are allocated at first use.
  static absl::StatusOr<std::unique_ptr<HostRunner>> Create(const HostRunnerOptions& options);
  ~HostRunner();
  HostRunner(const HostRunner&) = delete;
  HostRunner& operator=(const HostRunner&) = delete;

  // host: every pointer is host memory and the tensors are contiguous (SetContiguousStrides in
  // either layout, or packed varlen). Returns when o (and lse) hold the result. Thread-safe.
  absl::StatusOr<HostRunTimes> Run(const AttentionParams& host);

  // Runs `items` (pairwise CanShareLaunch with items[0]) in one launch; the times are the
  // launch's, shared by every item. One error fails them all. Thread-safe.
  absl::StatusOr<HostRunTimes> RunBatch(absl::Span<const AttentionParams> items);

  // Device bytes RunBatch(items) needs at most: q, k, v, o, lse and cu_seqlens, padded and
  // aligned, and for float8 the larger of its two paths' extra buffers (bfloat16 copies of q, k,
  // v, or V transposed).
  static int64_t DeviceBytes(absl::Span<const AttentionParams> items);
  int64_t memory_budget_bytes() const { return budget_; }

 private:
  struct Stream;
  explicit HostRunner(const HostRunnerOptions& options, int64_t budget);

  // Takes a free stream, waiting for one; Release gives it back.
  Stream* Acquire();
  void Release(Stream* stream);
  // Grows `stream`'s device buffer to `bytes`, within the budget (see the file comment).
  absl::Status ReserveDevice(Stream* stream, int64_t bytes);
  // Grows `stream`'s pinned staging buffer to `bytes`.
  absl::Status ReserveStaging(Stream* stream, int64_t bytes);
  // RunBatch on a held stream: the exact path's items on the CPU, the rest in one launch (RunOn).
  absl::StatusOr<HostRunTimes> RunHeld(Stream* stream, absl::Span<const AttentionParams> items);
  // Per item of a masked batch: whether it takes the exact path (its V holds Inf or NaN), V
  // scanned where `scan` (PlanVScan) says: on the host, or on the device (NonFiniteScan).
  absl::StatusOr<std::vector<bool>> NeedsExactPath(Stream* stream,
                                                   absl::Span<const AttentionParams> items,
                                                   absl::Span<const VScan> scan);
  // The exact CPU kernel on `item`; tensors in device memory are copied to the host for it and o
  // and lse back.
  absl::Status RunExact(Stream* stream, const AttentionParams& item);
  // One launch of `items`, whose tensors lie at `homes`, as PlanLaunch decides it.
  absl::StatusOr<HostRunTimes> RunOn(Stream* stream, absl::Span<const AttentionParams> items,
                                     absl::Span<const TensorHomes> homes);
  // The exact CPU kernel of the calls that fall back (file comment), created at first use.
  cpu::CpuBackend& ExactBackend();

  const HostRunnerOptions options_;
  const int64_t budget_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::mutex mu_;
  std::condition_variable released_;
  std::vector<Stream*> free_;  // guarded by mu_
  int64_t reserved_ = 0;       // guarded by mu_: device bytes held by all streams
  std::once_flag exact_once_;
  std::unique_ptr<cpu::CpuBackend> exact_;
};

}  // namespace attention::cuda
