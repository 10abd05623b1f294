#include "kernels/cuda/runtime/host_runner.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/cuda/forward/cuda_attention.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/device_caps.h"
#include "kernels/cuda/prep/dequantise.h"
#include "kernels/cuda/prep/non_finite_scan.h"
#include "kernels/cuda/runtime/stream_buffers.h"
#include "kernels/non_finite.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {

// Buffers grow in steps of this much, so slightly larger calls do not reallocate each time.
constexpr int64_t kGrowStep = int64_t{2} << 20;

int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// V's elements: [rows_k, Hkv, D] (BSHD, varlen) or [B, Hkv, Nk, D] (BHSD), contiguous.
int64_t ElementsV(const AttentionParams& p) { return RowsK(p) * p.heads_kv * p.head_dim; }

// Where `ptr` is, for `device`'s copies: pinned (or registered) host memory and memory of
// `device` itself (a client's CUDA IPC region, copied device to device) are DMA'd directly, with
// no staging memcpy; anything else is pageable.
Home HomeOf(const void* ptr, int device) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear it: an unknown pointer is just not pinned
    return Home::kPageable;
  }
  if (attr.type == cudaMemoryTypeHost) return Home::kPinned;
  if (attr.type == cudaMemoryTypeDevice && attr.device == device) return Home::kDevice;
  return Home::kPageable;
}

// Whether `ptr` is memory of `device` itself.
bool OnDevice(const void* ptr, int device) { return HomeOf(ptr, device) == Home::kDevice; }

// Where each item's tensors are (lse only when the items have one).
std::vector<TensorHomes> HomesOf(absl::Span<const AttentionParams> items, int device) {
  std::vector<TensorHomes> homes(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const AttentionParams& item = items[i];
    homes[i] = {.q = HomeOf(item.q, device),
                .k = HomeOf(item.k, device),
                .v = HomeOf(item.v, device),
                .o = HomeOf(item.o, device),
                .lse = item.lse != nullptr ? HomeOf(item.lse, device) : Home::kPageable};
  }
  return homes;
}

// memcpy, split over threads when large: one thread copies at 5-6 GB/s (measured on the H200
// host), well below the 55 GB/s DMA that follows it.
void ParallelCopy(void* dst, const void* src, size_t bytes) {
  constexpr size_t kSplitAbove = size_t{8} << 20;
  constexpr int kThreads = 4;
  if (bytes < kSplitAbove) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Rounded up: the parts cover every byte (bytes / kThreads rounded down could leave up to
  // kThreads - 1 bytes at the end uncopied).
  const size_t part = ((bytes + kThreads - 1) / kThreads + 63) / 64 * 64;
  auto copy = [&](int t) {
    const size_t begin = std::min(bytes, t * part), end = std::min(bytes, begin + part);
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                end - begin);
  };
  std::thread helpers[kThreads - 1];
  for (int t = 1; t < kThreads; ++t) helpers[t - 1] = std::thread(copy, t);
  copy(0);
  for (std::thread& h : helpers) h.join();
}

// A buffer's regions (device or staging) by index, from Packing::offsets.
struct Regions {
  char* base;
  const int64_t* offsets;
  // Null while the stream has no buffer (a request run in place, without lse, takes none).
  char* at(int i) const { return base == nullptr ? nullptr : base + offsets[i]; }
};

}  // namespace

// One stream with its events and buffers. Owned by the runner; used by one call at a time.
struct HostRunner::Stream {
  cudaStream_t stream = nullptr;
  cudaEvent_t events[4] = {};  // before h2d, before the kernel, after it, after the d2h copies
  // Its size is guarded by the runner's mu_ while the stream is free.
  GrowableBuffer device{GrowableBuffer::Kind::kDevice};
  GrowableBuffer staging{GrowableBuffer::Kind::kPinned};
  // The device scan of V (masked requests with V in device memory): a flag word per item, on the
  // device and its pinned mirror, grown to the largest batch scanned.
  GrowableBuffer scan_flags{GrowableBuffer::Kind::kDevice};
  GrowableBuffer scan_flags_host{GrowableBuffer::Kind::kPinned};
  ForwardScratch forward_scratch;  // this stream's forward launches'
};

absl::StatusOr<std::unique_ptr<HostRunner>> HostRunner::Create(const HostRunnerOptions& options) {
  if (options.streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams: expected >= 1, got ", options.streams));
  }
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options.device), "cudaSetDevice");
  int64_t budget = options.memory_budget_bytes;
  if (budget <= 0) budget = std::numeric_limits<int64_t>::max();
  std::unique_ptr<HostRunner> runner(new HostRunner(options, budget));
  for (int i = 0; i < options.streams; ++i) {
    auto s = std::make_unique<Stream>();
    // Owned by `runner` from here, so its destructor frees whatever was created.
    runner->streams_.push_back(std::move(s));
    Stream* stream = runner->streams_.back().get();
    ASSIGN_OR_RETURN(stream->stream, CreateStream());
    RETURN_IF_ERROR(CreateEvents(stream->events));
    ASSIGN_OR_RETURN(stream->forward_scratch, AllocateForwardScratch());
    runner->free_.push_back(stream);
  }
  return runner;
}

HostRunner::HostRunner(const HostRunnerOptions& options, int64_t budget)
    : options_(options), budget_(budget) {}

cpu::CpuBackend& HostRunner::ExactBackend() {
  std::call_once(exact_once_, [this] { exact_ = std::make_unique<cpu::CpuBackend>(); });
  return *exact_;
}

HostRunner::~HostRunner() {
  cudaSetDevice(options_.device);
  for (const std::unique_ptr<Stream>& s : streams_) {
    if (s->stream) cudaStreamSynchronize(s->stream);
    // The stream's buffers go with it (GrowableBuffer).
    FreeForwardScratch(s->forward_scratch);
    DestroyEvents(s->events);
    if (s->stream) cudaStreamDestroy(s->stream);
  }
}

HostRunner::Stream* HostRunner::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  released_.wait(lock, [this] { return !free_.empty(); });
  Stream* s = free_.back();
  free_.pop_back();
  return s;
}

void HostRunner::Release(Stream* stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(stream);
  }
  released_.notify_all();
}

absl::Status HostRunner::ReserveDevice(Stream* stream, int64_t bytes) {
  if (bytes <= static_cast<int64_t>(stream->device.bytes())) return absl::OkStatus();
  bytes = RoundUp(bytes, kGrowStep);
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The old buffer goes first: its contents are not needed and its bytes count.
    reserved_ -= stream->device.bytes();
    stream->device.Free();
    // Short of budget: free idle streams' buffers (they regrow when next used); if that is not
    // enough, wait for busy streams to come back and free theirs. Every stream comes back, so
    // this ends; `bytes` <= budget was checked by the caller (rounded up within the budget).
    while (reserved_ + bytes > budget_) {
      for (Stream* idle : free_) {
        reserved_ -= idle->device.bytes();
        idle->device.Free();
      }
      if (reserved_ + bytes <= budget_) break;
      released_.wait(lock);
    }
    reserved_ += bytes;
  }
  if (absl::Status grown = stream->device.Grow(bytes, "the forward pass"); !grown.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= bytes;
    return grown;
  }
  return absl::OkStatus();
}

absl::Status HostRunner::ReserveStaging(Stream* stream, int64_t bytes) {
  if (bytes <= static_cast<int64_t>(stream->staging.bytes())) return absl::OkStatus();
  return stream->staging.Grow(RoundUp(bytes, kGrowStep), "the forward pass's staging");
}

int64_t HostRunner::DeviceBytes(absl::Span<const AttentionParams> items) {
  const AttentionParams& first = items[0];
  Packing packing = Pack(items);
  const int64_t d8 = PaddedHeadDim(first.head_dim);
  auto bytes = [&](const Float8Path& path) {
    return packing.Regions(d8, DTypeSize(first.dtype), DTypeSize(OutputDType(first.dtype)),
                           first.lse != nullptr, path);
  };
  if (first.dtype != DType::kFloat8E4M3) return bytes({});
  // Either float8 path, whichever the device's plan takes: the larger. The native one's
  // workspace is V^T, [sequences, Hkv, D8, keys rounded up to 16] bytes (dense calls only).
  const int64_t transposed_v =
      TransposedVBytes(packing.sequences, first.heads_kv, d8, first.seqlen_k);
  return std::max(bytes({.dequantise = true}), bytes({.workspace_bytes = transposed_v}));
}

absl::StatusOr<Float8Path> PlanFloat8(absl::Span<const AttentionParams> items,
                                      const DeviceCaps& caps,
                                      std::optional<ForwardVariant> variant) {
  const AttentionParams& first = items[0];
  if (first.dtype != DType::kFloat8E4M3) return Float8Path{};
  const Packing pack = Pack(items);
  // The launch RunOn makes, as far as the plan looks at it: dtype, head dim, batch, key length,
  // heads and whether it is varlen (any cu_seqlens pointer says so; the plan reads none).
  AttentionParams probe = first;
  probe.head_dim = PaddedHeadDim(first.head_dim);
  probe.batch = pack.sequences;
  static constexpr int32_t kVarlen[1] = {0};
  probe.cu_seqlens_q = probe.cu_seqlens_k = pack.varlen ? kVarlen : nullptr;
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(probe, caps, variant);
  if (plan.ok()) return Float8Path{.workspace_bytes = plan->workspace_bytes};
  // INVALID_ARGUMENT: the variant takes no float8 for this call; bfloat16 copies it is.
  if (absl::IsInvalidArgument(plan.status())) return Float8Path{.dequantise = true};
  return plan.status();
}

absl::StatusOr<HostRunTimes> HostRunner::Run(const AttentionParams& host) {
  return RunBatch(absl::MakeConstSpan(&host, 1));
}

absl::StatusOr<HostRunTimes> HostRunner::RunBatch(absl::Span<const AttentionParams> items) {
  if (items.empty()) return absl::InvalidArgumentError("RunBatch: no items");
  for (const AttentionParams& item : items) {
    RETURN_IF_ERROR(CheckParams(item));
    RETURN_IF_ERROR(RefuseUnservedOptions(item));
  }
  if (!IsOneLaunch(items)) {
    return absl::InvalidArgumentError("RunBatch: items cannot share a launch");
  }
  // The budget first, before any stream or memory is taken.
  if (const int64_t need = DeviceBytes(items); RoundUp(need, kGrowStep) > budget_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda backend: the request needs ", RoundUp(need, kGrowStep),
                     " bytes of device memory, over the budget of ", budget_, " bytes"));
  }
  Stream* stream = Acquire();
  absl::StatusOr<HostRunTimes> times = RunHeld(stream, items);
  if (!times.ok()) {
    // Whatever was enqueued before the error finishes (or fails) before the stream is reused;
    // a non-sticky error is cleared so the next call starts clean.
    cudaStreamSynchronize(stream->stream);
    cudaGetLastError();
  }
  Release(stream);
  return times;
}

absl::StatusOr<HostRunTimes> HostRunner::RunHeld(Stream* stream,
                                                 absl::Span<const AttentionParams> items) {
  // Masked requests with a non-finite V run on the exact CPU kernel (file comment); the rest of
  // the batch still shares one launch. Unmasked batches skip the scan. The stream stays held
  // while the CPU computes (those inputs are pathological; the other streams keep serving).
  const std::vector<TensorHomes> homes = HomesOf(items, options_.device);
  const std::vector<VScan> scan = PlanVScan(items, homes);
  if (scan[0] == VScan::kNone) return RunOn(stream, items, homes);
  ASSIGN_OR_RETURN(const std::vector<bool> exact, NeedsExactPath(stream, items, scan));
  std::vector<AttentionParams> on_device;
  std::vector<TensorHomes> on_device_homes;
  double exact_us = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!exact[i]) {
      on_device.push_back(items[i]);
      on_device_homes.push_back(homes[i]);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(RunExact(stream, items[i]));
    exact_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
  if (on_device.empty()) return HostRunTimes{.compute_us = exact_us};
  ASSIGN_OR_RETURN(HostRunTimes times, RunOn(stream, on_device, on_device_homes));
  times.compute_us += exact_us;
  return times;
}

absl::StatusOr<std::vector<bool>> HostRunner::NeedsExactPath(
    Stream* stream, absl::Span<const AttentionParams> items, absl::Span<const VScan> scan) {
  // All of V is scanned, not only the keys some rows mask: a key every row sees gives NaN rows on
  // either backend, so the wider scan costs only a slower, still exact, answer on such inputs.
  std::vector<bool> exact(items.size(), false);
  std::vector<size_t> scan_on_device;  // items whose V is in this device's memory
  for (size_t i = 0; i < items.size(); ++i) {
    const AttentionParams& item = items[i];
    if (scan[i] == VScan::kDevice) {
      scan_on_device.push_back(i);
    } else {
      exact[i] = HoldsNonFinite(item.dtype, item.v, ElementsV(item));
    }
  }
  if (scan_on_device.empty()) return exact;
  // V in device memory (a client's CUDA IPC region) is scanned where it is, with the host scan's
  // bit test (NonFiniteBitsOf), so the request takes the path it would take from the host: V
  // never crosses to the host for the check (a 64 MiB V: ~20 us of HBM instead of ~1 ms of PCIe
  // plus the host scan).
  const int64_t n = static_cast<int64_t>(scan_on_device.size());
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const size_t flag_bytes = n * sizeof(unsigned int);
  RETURN_IF_ERROR(stream->scan_flags.Grow(flag_bytes, "the flags of the V scan"));
  RETURN_IF_ERROR(stream->scan_flags_host.Grow(flag_bytes, "the flags of the V scan"));
  auto* flags = reinterpret_cast<unsigned int*>(stream->scan_flags.data());
  const auto* flags_host = reinterpret_cast<const unsigned int*>(stream->scan_flags_host.data());
  cudaStream_t cs = stream->stream;
  RETURN_IF_CUDA_ERROR(cudaMemsetAsync(flags, 0, flag_bytes, cs), "clear the flags of the V scan");
  for (int64_t j = 0; j < n; ++j) {
    const AttentionParams& item = items[scan_on_device[j]];
    RETURN_IF_CUDA_ERROR(
        LaunchNonFiniteScan(item.v, ElementsV(item), static_cast<int>(DTypeSize(item.dtype)),
                            NonFiniteBitsOf(item.dtype), flags + j, cs),
        "scan V for Inf and NaN on the device");
  }
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(stream->scan_flags_host.data(), flags, flag_bytes,
                                       cudaMemcpyDeviceToHost, cs),
                       "copy the flags of the V scan");
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(cs), "scan V for Inf and NaN on the device");
  for (int64_t j = 0; j < n; ++j) exact[scan_on_device[j]] = flags_host[j] != 0;
  return exact;
}

absl::Status HostRunner::RunExact(Stream* stream, const AttentionParams& item) {
  const int device = options_.device;
  const bool q_dev = OnDevice(item.q, device), k_dev = OnDevice(item.k, device),
             v_dev = OnDevice(item.v, device), o_dev = OnDevice(item.o, device),
             lse_dev = item.lse != nullptr && OnDevice(item.lse, device);
  if (!(q_dev || k_dev || v_dev || o_dev || lse_dev)) return ExactBackend().Forward(item);
  // Tensors in this device's memory (a client's CUDA IPC region) go to host buffers for the CPU
  // kernel, and o and lse come back after it: the kernel reads the bytes it would read from the
  // host, so the answer equals the host path's bit for bit. Slow, but only for pathological V.
  const size_t elem = DTypeSize(item.dtype);
  const int64_t q_bytes = RowsQ(item) * item.heads_q * item.head_dim * elem;
  const int64_t kv_bytes = ElementsV(item) * elem;
  // o [rows, Hq, D] in the output dtype (bfloat16 for float8 inputs).
  const int64_t o_bytes = RowsQ(item) * item.heads_q * item.head_dim *
                          static_cast<int64_t>(DTypeSize(OutputDType(item.dtype)));
  const int64_t lse_bytes = RowsQ(item) * item.heads_q * int64_t{sizeof(float)};
  std::vector<char> q, k, v, o, lse;
  AttentionParams host = item;
  cudaStream_t cs = stream->stream;
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
  auto to_host = [&](const void* src, int64_t bytes, std::vector<char>* buf) {
    buf->resize(bytes);
    return cudaMemcpyAsync(buf->data(), src, bytes, cudaMemcpyDeviceToHost, cs);
  };
  if (q_dev) {
    RETURN_IF_CUDA_ERROR(to_host(item.q, q_bytes, &q), "copy q to the host");
    host.q = q.data();
  }
  if (k_dev) {
    RETURN_IF_CUDA_ERROR(to_host(item.k, kv_bytes, &k), "copy k to the host");
    host.k = k.data();
  }
  if (v_dev) {
    RETURN_IF_CUDA_ERROR(to_host(item.v, kv_bytes, &v), "copy v to the host");
    host.v = v.data();
  }
  if (o_dev) {
    o.resize(o_bytes);
    host.o = o.data();
  }
  if (lse_dev) {
    lse.resize(lse_bytes);
    host.lse = reinterpret_cast<float*>(lse.data());
  }
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(cs), "copy q, k, v to the host");
  RETURN_IF_ERROR(ExactBackend().Forward(host));
  if (o_dev) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(item.o, o.data(), o_bytes, cudaMemcpyHostToDevice, cs),
                         "copy o to the device");
  }
  if (lse_dev) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(item.lse, lse.data(), lse_bytes, cudaMemcpyHostToDevice, cs),
        "copy lse to the device");
  }
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(cs), "copy o and lse to the device");
  return absl::OkStatus();
}

absl::StatusOr<HostRunTimes> HostRunner::RunOn(Stream* stream,
                                               absl::Span<const AttentionParams> items,
                                               absl::Span<const TensorHomes> homes) {
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const AttentionParams& first = items[0];
  Float8Path float8;
  if (first.dtype == DType::kFloat8E4M3) {
    ASSIGN_OR_RETURN(const DeviceCaps caps, GetDeviceCaps(options_.device));
    ASSIGN_OR_RETURN(float8, PlanFloat8(items, caps, options_.forward_variant));
  }
  // Every decision of the launch (launch_plan.h); what follows carries it out.
  const LaunchPlan plan = PlanLaunch(items, homes, float8);
  const size_t elem = DTypeSize(first.dtype);                 // q, k, v as they come
  const size_t o_elem = DTypeSize(OutputDType(first.dtype));  // o
  const int64_t d = plan.head_dim, d8 = plan.padded_head_dim;
  const bool with_lse = first.lse != nullptr;
  const bool dequantise = float8.dequantise;
  if (plan.reserve_buffers) {
    RETURN_IF_ERROR(ReserveDevice(stream, plan.device_bytes));
    RETURN_IF_ERROR(ReserveStaging(stream, plan.staging_bytes));
  }
  const Regions dev{reinterpret_cast<char*>(stream->device.data()), plan.device.offsets};
  const Regions host{reinterpret_cast<char*>(stream->staging.data()), plan.staging.offsets};
  cudaStream_t cs = stream->stream;

  // The launch's params (LaunchParams); float8 that is dequantised first is read as it came,
  // from `quantised` (copied in, or in place), into q16, k16, v16, which the kernel reads.
  const AttentionParams launch = LaunchParams(plan, first, dev.base);
  const void* const quantised[3] = {plan.in_place ? first.q : dev.at(Packing::kQ),
                                    plan.in_place ? first.k : dev.at(Packing::kK),
                                    plan.in_place ? first.v : dev.at(Packing::kV)};
  const size_t cu_bytes = plan.cu_seqlens_q.size() * sizeof(int32_t);
  if (plan.device.varlen) {
    // cu_seqlens: [sequences + 1] each, through the staging buffer.
    std::memcpy(host.at(Packing::kCuQ), plan.cu_seqlens_q.data(), cu_bytes);
    std::memcpy(host.at(Packing::kCuK), plan.cu_seqlens_k.data(), cu_bytes);
  }
  // The kernel's own checks (sizes that fit the grid, ...) and its plan before any copy is
  // enqueued; its workspace is the one PlanFloat8 sized.
  ASSIGN_OR_RETURN(const ForwardLaunch forward, PrepareForward(launch, options_.forward_variant));
  if (forward.plan.workspace_bytes > float8.workspace_bytes) {
    return absl::InternalError(absl::StrCat("the forward plan needs ", forward.plan.workspace_bytes,
                                            " bytes of workspace; ", float8.workspace_bytes,
                                            " were reserved"));
  }

  // Inputs, in the plan's order: staging memcpys, the DMA of each run of staged lines, and the
  // direct DMAs of pinned and device tensors.
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[0], cs), "cudaEventRecord");
  // Lines [line, line + lines) of `region` from host memory `src` (pinned) to the device.
  auto dma_in = [&](int region, int64_t line, const void* src, int64_t lines) -> cudaError_t {
    char* dst = dev.at(region) + line * d8 * elem;
    // cudaMemcpyDefault: `src` is pinned host memory or this device's (unified addressing).
    if (d8 == d) return cudaMemcpyAsync(dst, src, lines * d * elem, cudaMemcpyDefault, cs);
    cudaError_t err = cudaMemsetAsync(dst, 0, lines * d8 * elem, cs);
    if (err != cudaSuccess) return err;
    return cudaMemcpy2DAsync(dst, d8 * elem, src, d * elem, d * elem, lines, cudaMemcpyDefault, cs);
  };
  for (const CopyStep& step : plan.copies_in) {
    const AttentionParams& item = items[step.item];
    const void* src = step.region == Packing::kQ   ? item.q
                      : step.region == Packing::kK ? item.k
                                                   : item.v;
    char* staged = host.at(step.region) + step.line * d * elem;
    switch (step.kind) {
      case CopyStep::kStage:
        ParallelCopy(staged, src, step.lines * d * elem);
        break;
      case CopyStep::kStagedRun:
        RETURN_IF_CUDA_ERROR(dma_in(step.region, step.line, staged, step.lines),
                             "copy q, k, v to the device");
        break;
      case CopyStep::kDirect:
        RETURN_IF_CUDA_ERROR(dma_in(step.region, step.line, src, step.lines),
                             "copy q, k, v to the device");
        break;
    }
  }
  if (plan.device.varlen) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev.at(Packing::kCuQ), host.at(Packing::kCuQ), cu_bytes,
                                         cudaMemcpyHostToDevice, cs),
                         "copy cu_seqlens_q to the device");
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev.at(Packing::kCuK), host.at(Packing::kCuK), cu_bytes,
                                         cudaMemcpyHostToDevice, cs),
                         "copy cu_seqlens_k to the device");
  }
  const int64_t o_dev_bytes = plan.device.lines_q * d8 * o_elem;
  const int64_t lse_bytes = with_lse ? plan.device.lines_q * int64_t{sizeof(float)} : 0;
  if (options_.poison_outputs) {
    // All-ones bytes are NaN in float32, float16 and bfloat16.
    // In place, o is the client's tensor the kernel writes (launch.o).
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(launch.o, 0xff, o_dev_bytes, cs), "poison o");
    if (with_lse)
      RETURN_IF_CUDA_ERROR(cudaMemsetAsync(launch.lse, 0xff, lse_bytes, cs), "poison lse");
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[1], cs), "cudaEventRecord");
  if (dequantise) {
    const int64_t lines[3] = {plan.device.lines_q, plan.device.lines_k, plan.device.lines_k};
    for (int t = 0; t < 3; ++t) {
      RETURN_IF_CUDA_ERROR(
          LaunchDequantiseE4m3ToBf16(quantised[t], dev.at(Packing::kQ16 + t), lines[t] * d8, cs),
          "dequantise float8 q, k, v");
    }
  }
  RETURN_IF_ERROR(
      LaunchForward(forward, cs, stream->forward_scratch,
                    forward.plan.workspace_bytes > 0 ? dev.at(Packing::kWorkspace) : nullptr));
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[2], cs), "cudaEventRecord");

  // Outputs: o straight into a pinned destination, else into staging (consecutive staged items
  // in one DMA); lse always into staging (its packed layout differs from the items' when varlen).
  auto dma_out = [&](char* dst, int64_t line, int64_t lines) -> cudaError_t {
    const char* src = dev.at(Packing::kO) + line * d8 * o_elem;
    return d8 == d ? cudaMemcpyAsync(dst, src, lines * d * o_elem, cudaMemcpyDefault, cs)
                   : cudaMemcpy2DAsync(dst, d * o_elem, src, d8 * o_elem, d * o_elem, lines,
                                       cudaMemcpyDefault, cs);
  };
  for (const CopyStep& step : plan.copies_out) {
    char* dst = step.kind == CopyStep::kDirect ? static_cast<char*>(items[step.item].o)
                                               : host.at(Packing::kO) + step.line * d * o_elem;
    RETURN_IF_CUDA_ERROR(dma_out(dst, step.line, step.lines), "copy o to the host");
  }
  if (plan.lse_to_host) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host.at(Packing::kLse), dev.at(Packing::kLse), lse_bytes,
                                         cudaMemcpyDeviceToHost, cs),
                         "copy lse to the host");
  }
  for (size_t i = 0; i < items.size() && with_lse && !plan.lse_in_place; ++i) {
    if (!plan.lse_on_device[i]) continue;
    const auto* packed = reinterpret_cast<const float*>(dev.at(Packing::kLse));
    cudaError_t err = cudaSuccess;
    ForEachLsePiece(items[i], plan.device, i,
                    [&](float* dst, int64_t dst_pitch, int64_t src, int64_t src_pitch,
                        int64_t width, int64_t height) {
                      if (err != cudaSuccess) return;
                      err = cudaMemcpy2DAsync(dst, dst_pitch * sizeof(float), packed + src,
                                              src_pitch * sizeof(float), width * sizeof(float),
                                              height, cudaMemcpyDeviceToDevice, cs);
                    });
    RETURN_IF_CUDA_ERROR(err, "copy lse device to device");
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[3], cs), "cudaEventRecord");
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(stream->events[3]), "run on the device");

  // Unstaging, on the host: o by item; lse by item, head and sequence when it was packed.
  const auto unstage_start = std::chrono::steady_clock::now();
  const auto* lse_packed = reinterpret_cast<const float*>(host.at(Packing::kLse));
  for (size_t i = 0; i < items.size(); ++i) {
    const AttentionParams& item = items[i];
    const int64_t lines = RowsQ(item) * item.heads_q;
    if (plan.o_staged[i]) {
      ParallelCopy(item.o, host.at(Packing::kO) + plan.device.line_q[i] * d * o_elem,
                   lines * d * o_elem);
    }
    if (!with_lse || plan.lse_on_device[i]) continue;
    ForEachLsePiece(item, plan.device, i,
                    [&](float* dst, int64_t dst_pitch, int64_t src, int64_t src_pitch,
                        int64_t width, int64_t height) {
                      for (int64_t h = 0; h < height; ++h) {
                        std::memcpy(dst + h * dst_pitch, lse_packed + src + h * src_pitch,
                                    width * sizeof(float));
                      }
                    });
  }
  const double unstage_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - unstage_start)
          .count();

  float ms[3];
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms[i], stream->events[i], stream->events[i + 1]),
                         "cudaEventElapsedTime");
  }
  // h2d spans the staging memcpys too (events[0] is recorded before them on an idle stream);
  // d2h adds the host unstaging after the DMA. In place, nothing is copied in, and nothing out
  // unless lse goes to the host: those stages are 0 (the events would time back-to-back records).
  return HostRunTimes{plan.copies_to_device ? ms[0] * 1e3 : 0.0, ms[1] * 1e3,
                      plan.copies_to_host ? ms[2] * 1e3 + unstage_us : 0.0};
}

}  // namespace attention::cuda
