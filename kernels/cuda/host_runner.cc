#include "kernels/cuda/host_runner.h"

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
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dequantise.h"
#include "kernels/cuda/device_caps.h"
#include "kernels/cuda/non_finite_scan.h"
#include "kernels/non_finite.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {

constexpr int64_t kAlign = 256;
// Buffers grow in steps of this much, so slightly larger calls do not reallocate each time.
constexpr int64_t kGrowStep = int64_t{2} << 20;

int64_t RoundUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Dense q is [B, N, H, D] (rows advance by H*D); with one head both layouts are the same memory.
bool IsBshd(const AttentionParams& p) { return p.q_row_stride == p.heads_q * p.head_dim; }
// Packable as varlen rows: varlen already, or dense BSHD.
bool Packable(const AttentionParams& p) { return p.is_varlen() || IsBshd(p); }

int64_t RowsQ(const AttentionParams& p) { return p.is_varlen() ? p.total_q : p.batch * p.seqlen_q; }
int64_t RowsK(const AttentionParams& p) { return p.is_varlen() ? p.total_k : p.batch * p.seqlen_k; }

// Whether the mask hides some keys from some rows (a causal or window mask). Without one, the only
// keys a row cannot see are those past Nk, which the kernel zero-fills.
bool Masked(const AttentionParams& p) {
  return p.window_left != kUnboundedWindow || p.window_right != kUnboundedWindow;
}

// V's elements: [rows_k, Hkv, D] (BSHD, varlen) or [B, Hkv, Nk, D] (BHSD), contiguous.
int64_t ElementsV(const AttentionParams& p) { return RowsK(p) * p.heads_kv * p.head_dim; }

// How a launch serves float8 inputs: the plan's kernel reads them as they are (wgmma_sm90 on dense
// calls at head dims 128 and 256, with V transposed into a workspace), or they are dequantised to
// bfloat16 copies first (dequantise.h) for the kernels that take no float8.
struct Float8Path {
  bool dequantise = false;
  int64_t workspace_bytes = 0;  // the launch's workspace (ForwardPlan::workspace_bytes)
  // Bytes per element of the kernel's copies of q, k, v: 0 when it reads them as they come.
  size_t dequantised_elem() const { return dequantise ? DTypeSize(DType::kBFloat16) : 0; }
};

// Whether `ptr` is memory of `device` itself.
bool OnDevice(const void* ptr, int device) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice && attr.device == device;
}

// Whether the DMA engines can copy `ptr` straight to or from `device`'s buffers, with no staging
// memcpy: pinned (or registered) host memory, or memory of `device` itself (a client's CUDA IPC
// region, which the copies then move device to device).
bool CopiesDirectly(const void* ptr, int device) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear it: an unknown pointer is just not pinned
    return false;
  }
  return attr.type == cudaMemoryTypeHost || OnDevice(ptr, device);
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

// Where each tensor of a launch lives, in one buffer laid out
// q | k | v | o | lse | cu_q | cu_k | q16 | k16 | v16 | workspace (each region 256-byte aligned);
// q16, k16 and v16 are the bfloat16 copies of float8 inputs that the kernel reads, workspace the
// launch's own (float8 V transposed); both device buffer only, empty otherwise. The device buffer
// has lines of D8 elements, the pinned staging buffer lines of D: items are packed one after
// another in both.
struct Packing {
  bool varlen = false;  // packed as varlen [total, H, D] (else concatenated along B)
  int64_t lines_q = 0;  // rows * heads, all items
  int64_t lines_k = 0;
  int64_t rows_q = 0;     // query rows, all items (the lse's inner extent when varlen)
  int64_t sequences = 0;  // batch items after packing
  std::vector<int64_t> line_q, line_k, row_q;  // per item: first q line, k line and q row
  int64_t offsets[12] = {0};                   // region starts; offsets[11] is the total

  // Sizes the regions for elements of in_elem bytes (q, k, v), out_elem (o), float8's `path`
  // (dequantised copies of q, k, v, or a workspace); returns the total.
  int64_t Regions(int64_t line_elems, size_t in_elem, size_t out_elem, bool lse,
                  const Float8Path& path = {}) {
    const size_t dequantised_elem = path.dequantised_elem();
    const int64_t q = lines_q * line_elems * in_elem, k = lines_k * line_elems * in_elem;
    const int64_t o = lines_q * line_elems * out_elem;
    const int64_t q16 = lines_q * line_elems * dequantised_elem;
    const int64_t k16 = lines_k * line_elems * dequantised_elem;
    const int64_t lse_bytes = lse ? lines_q * int64_t{sizeof(float)} : 0;
    const int64_t cu = varlen ? (sequences + 1) * int64_t{sizeof(int32_t)} : 0;
    const int64_t sizes[11] = {q, k, k, o, lse_bytes, cu, cu, q16, k16, k16, path.workspace_bytes};
    for (int i = 0; i < 11; ++i) offsets[i + 1] = offsets[i] + RoundUp(sizes[i], kAlign);
    return offsets[11];
  }
};

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

// A buffer's regions (device or staging) by index, from Packing::offsets.
struct Regions {
  char* base;
  const int64_t* offsets;
  // Null while the stream has no buffer (a request run in place, without lse, takes none).
  char* at(int i) const { return base == nullptr ? nullptr : base + offsets[i]; }
};

// Where item i's lse lies in the launch's packed lse (region 4): calls
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

// One stream with its events and buffers. Owned by the runner; used by one call at a time.
struct HostRunner::Stream {
  cudaStream_t stream = nullptr;
  cudaEvent_t events[4] = {};  // before h2d, before the kernel, after it, after the d2h copies
  void* device = nullptr;
  int64_t device_bytes = 0;  // guarded by the runner's mu_ while the stream is free
  void* staging = nullptr;
  int64_t staging_bytes = 0;
  // The device scan of V (masked requests with V in device memory): a flag word per item, on the
  // device and its pinned mirror, grown to the largest batch scanned.
  unsigned int* scan_flags = nullptr;
  unsigned int* scan_flags_host = nullptr;
  int64_t scan_capacity = 0;
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
    RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream->stream, cudaStreamNonBlocking),
                         "cudaStreamCreate");
    for (cudaEvent_t& e : stream->events)
      RETURN_IF_CUDA_ERROR(cudaEventCreate(&e), "cudaEventCreate");
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
    cudaFree(s->device);
    cudaFreeHost(s->staging);
    cudaFree(s->scan_flags);
    cudaFreeHost(s->scan_flags_host);
    FreeForwardScratch(s->forward_scratch);
    for (cudaEvent_t e : s->events) {
      if (e) cudaEventDestroy(e);
    }
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
  if (bytes <= stream->device_bytes) return absl::OkStatus();
  bytes = RoundUp(bytes, kGrowStep);
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The old buffer goes first: its contents are not needed and its bytes count.
    cudaFree(stream->device);
    stream->device = nullptr;
    reserved_ -= stream->device_bytes;
    stream->device_bytes = 0;
    // Short of budget: free idle streams' buffers (they regrow when next used); if that is not
    // enough, wait for busy streams to come back and free theirs. Every stream comes back, so
    // this ends; `bytes` <= budget was checked by the caller (rounded up within the budget).
    while (reserved_ + bytes > budget_) {
      for (Stream* idle : free_) {
        if (idle->device_bytes == 0) continue;
        cudaFree(idle->device);
        idle->device = nullptr;
        reserved_ -= idle->device_bytes;
        idle->device_bytes = 0;
      }
      if (reserved_ + bytes <= budget_) break;
      released_.wait(lock);
    }
    reserved_ += bytes;
  }
  if (cudaError_t err = cudaMalloc(&stream->device, bytes); err != cudaSuccess) {
    stream->device = nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= bytes;
    return CudaError(err, absl::StrCat("cannot allocate ", bytes, " bytes of device memory"));
  }
  stream->device_bytes = bytes;
  return absl::OkStatus();
}

absl::Status HostRunner::ReserveStaging(Stream* stream, int64_t bytes) {
  if (bytes <= stream->staging_bytes) return absl::OkStatus();
  bytes = RoundUp(bytes, kGrowStep);
  cudaFreeHost(stream->staging);
  stream->staging = nullptr;
  stream->staging_bytes = 0;
  if (cudaError_t err = cudaHostAlloc(&stream->staging, bytes, cudaHostAllocPortable);
      err != cudaSuccess) {
    stream->staging = nullptr;
    return CudaError(err, absl::StrCat("cannot allocate ", bytes, " bytes of pinned host memory"));
  }
  stream->staging_bytes = bytes;
  return absl::OkStatus();
}

int64_t HostRunner::DeviceBytes(absl::Span<const AttentionParams> items) {
  const AttentionParams& first = items[0];
  Packing packing = Pack(items);
  const int64_t d8 = (first.head_dim + 7) / 8 * 8;
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

namespace {

// The float8 path of RunOn's launch of items packed as `pack` (first: the first item) on
// `device`, as the forward plan decides it.
absl::StatusOr<Float8Path> PlanFloat8(const AttentionParams& first, const Packing& pack, int device,
                                      std::optional<ForwardVariant> variant) {
  if (first.dtype != DType::kFloat8E4M3) return Float8Path{};
  // The launch RunOn makes, as far as the plan looks at it: dtype, head dim, batch, key length,
  // heads and whether it is varlen (any cu_seqlens pointer says so; the plan reads none).
  AttentionParams probe = first;
  probe.head_dim = (first.head_dim + 7) / 8 * 8;
  probe.batch = pack.sequences;
  static constexpr int32_t kVarlen[1] = {0};
  probe.cu_seqlens_q = probe.cu_seqlens_k = pack.varlen ? kVarlen : nullptr;
  ASSIGN_OR_RETURN(const DeviceCaps caps, GetDeviceCaps(device));
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(probe, caps, variant);
  if (plan.ok()) return Float8Path{.workspace_bytes = plan->workspace_bytes};
  // INVALID_ARGUMENT: the variant takes no float8 for this call; bfloat16 copies it is.
  if (absl::IsInvalidArgument(plan.status())) return Float8Path{.dequantise = true};
  return plan.status();
}

}  // namespace

absl::StatusOr<HostRunTimes> HostRunner::Run(const AttentionParams& host) {
  return RunBatch(absl::MakeConstSpan(&host, 1));
}

absl::StatusOr<HostRunTimes> HostRunner::RunBatch(absl::Span<const AttentionParams> items) {
  if (items.empty()) return absl::InvalidArgumentError("RunBatch: no items");
  for (const AttentionParams& item : items) {
    RETURN_IF_ERROR(CheckParams(item));
    RETURN_IF_ERROR(RefuseOpenModelOptions(item, "cuda"));
    if (!CanShareLaunch(items[0], item)) {
      return absl::InvalidArgumentError("RunBatch: items cannot share a launch");
    }
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
  if (!Masked(items[0])) return RunOn(stream, items);
  ASSIGN_OR_RETURN(const std::vector<bool> exact, NeedsExactPath(stream, items));
  std::vector<AttentionParams> on_device;
  double exact_us = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!exact[i]) {
      on_device.push_back(items[i]);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(RunExact(stream, items[i]));
    exact_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
  if (on_device.empty()) return HostRunTimes{.compute_us = exact_us};
  ASSIGN_OR_RETURN(HostRunTimes times, RunOn(stream, on_device));
  times.compute_us += exact_us;
  return times;
}

absl::StatusOr<std::vector<bool>> HostRunner::NeedsExactPath(
    Stream* stream, absl::Span<const AttentionParams> items) {
  // All of V is scanned, not only the keys some rows mask: a key every row sees gives NaN rows on
  // either backend, so the wider scan costs only a slower, still exact, answer on such inputs.
  std::vector<bool> exact(items.size(), false);
  std::vector<size_t> scan_on_device;  // items whose V is in this device's memory
  for (size_t i = 0; i < items.size(); ++i) {
    const AttentionParams& item = items[i];
    if (OnDevice(item.v, options_.device)) {
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
  if (n > stream->scan_capacity) {
    cudaFree(stream->scan_flags);
    cudaFreeHost(stream->scan_flags_host);
    stream->scan_flags = stream->scan_flags_host = nullptr;
    stream->scan_capacity = 0;
    RETURN_IF_CUDA_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&stream->scan_flags), n * sizeof(unsigned int)),
        "allocate the flags of the V scan");
    RETURN_IF_CUDA_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&stream->scan_flags_host),
                                       n * sizeof(unsigned int), cudaHostAllocPortable),
                         "allocate the flags of the V scan");
    stream->scan_capacity = n;
  }
  cudaStream_t cs = stream->stream;
  RETURN_IF_CUDA_ERROR(cudaMemsetAsync(stream->scan_flags, 0, n * sizeof(unsigned int), cs),
                       "clear the flags of the V scan");
  for (int64_t j = 0; j < n; ++j) {
    const AttentionParams& item = items[scan_on_device[j]];
    RETURN_IF_CUDA_ERROR(
        LaunchNonFiniteScan(item.v, ElementsV(item), static_cast<int>(DTypeSize(item.dtype)),
                            NonFiniteBitsOf(item.dtype), stream->scan_flags + j, cs),
        "scan V for Inf and NaN on the device");
  }
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(stream->scan_flags_host, stream->scan_flags,
                                       n * sizeof(unsigned int), cudaMemcpyDeviceToHost, cs),
                       "copy the flags of the V scan");
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(cs), "scan V for Inf and NaN on the device");
  for (int64_t j = 0; j < n; ++j) exact[scan_on_device[j]] = stream->scan_flags_host[j] != 0;
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
                                               absl::Span<const AttentionParams> items) {
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const AttentionParams& first = items[0];
  const size_t elem = DTypeSize(first.dtype);                 // q, k, v as they come
  const size_t o_elem = DTypeSize(OutputDType(first.dtype));  // o
  const int64_t d = first.head_dim, d8 = (d + 7) / 8 * 8;
  const bool with_lse = first.lse != nullptr;
  Packing dev_pack = Pack(items), host_pack = dev_pack;
  ASSIGN_OR_RETURN(const Float8Path float8,
                   PlanFloat8(first, dev_pack, options_.device, options_.forward_variant));
  const bool dequantise = float8.dequantise;

  const int64_t dev_bytes = dev_pack.Regions(d8, elem, o_elem, with_lse, float8);
  const int64_t host_bytes = host_pack.Regions(d, elem, o_elem, with_lse);
  // One dense request whose q, k, v and o are all in this device's memory (a client's CUDA IPC
  // region) with no padding to D8: the kernel reads and writes them where they are, no copy. The
  // kernel moves 16-byte chunks, so each must start on 16 bytes (a region reference is only
  // checked against its element size); others are copied (cudaMemcpy takes any alignment).
  auto in_place_ok = [&](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && OnDevice(p, options_.device);
  };
  const bool in_place = items.size() == 1 && d8 == d && !dev_pack.varlen && !first.is_varlen() &&
                        in_place_ok(first.q) && in_place_ok(first.k) && in_place_ok(first.v) &&
                        in_place_ok(first.o);
  // lse in this device's memory too: written there by the kernel (in place) or copied device to
  // device from the packed lse; lse_to_host: some item's lse is on the host.
  std::vector<bool> lse_on_device(items.size(), false);
  bool lse_to_host = false;
  for (size_t i = 0; i < items.size() && with_lse; ++i) {
    lse_on_device[i] = OnDevice(items[i].lse, options_.device);
    lse_to_host = lse_to_host || !lse_on_device[i];
  }
  const bool lse_in_place = in_place && with_lse && lse_on_device[0];
  // In place, the stream's buffers hold only float8's bfloat16 copies or workspace and an lse that
  // goes to the host: q, k, v and o need none, so without those they are neither allocated nor
  // grown.
  if (!in_place || dequantise || float8.workspace_bytes > 0 || (with_lse && !lse_in_place)) {
    RETURN_IF_ERROR(ReserveDevice(stream, dev_bytes));
    RETURN_IF_ERROR(ReserveStaging(stream, host_bytes));
  }
  const Regions dev{static_cast<char*>(stream->device), dev_pack.offsets};
  const Regions host{static_cast<char*>(stream->staging), host_pack.offsets};
  cudaStream_t cs = stream->stream;

  // The launch: items concatenated along B, or packed as varlen [total, H, D].
  AttentionParams launch = first;
  launch.head_dim = d8;
  launch.q = dev.at(0);
  launch.k = dev.at(1);
  launch.v = dev.at(2);
  launch.o = dev.at(3);
  launch.lse = with_lse ? reinterpret_cast<float*>(dev.at(4)) : nullptr;
  launch.batch = dev_pack.sequences;
  if (dev_pack.varlen) {
    launch.cu_seqlens_q = reinterpret_cast<const int32_t*>(dev.at(5));
    launch.cu_seqlens_k = reinterpret_cast<const int32_t*>(dev.at(6));
    launch.total_q = dev_pack.rows_q;
    launch.total_k = 0;
    launch.seqlen_q = launch.seqlen_k = 0;
    // cu_seqlens: [sequences + 1] each, built in the staging buffer from every item's own
    // (varlen) or from its B items of N rows (dense).
    auto* cu_q = reinterpret_cast<int32_t*>(host.at(5));
    auto* cu_k = reinterpret_cast<int32_t*>(host.at(6));
    int64_t seq = 0, row_q = 0, row_k = 0;
    cu_q[0] = cu_k[0] = 0;
    for (const AttentionParams& item : items) {
      for (int64_t b = 0; b < item.batch; ++b, ++seq) {
        const int64_t nq =
            item.is_varlen() ? item.cu_seqlens_q[b + 1] - item.cu_seqlens_q[b] : item.seqlen_q;
        const int64_t nk =
            item.is_varlen() ? item.cu_seqlens_k[b + 1] - item.cu_seqlens_k[b] : item.seqlen_k;
        row_q += nq;
        row_k += nk;
        cu_q[seq + 1] = static_cast<int32_t>(row_q);
        cu_k[seq + 1] = static_cast<int32_t>(row_k);
        launch.seqlen_q = std::max(launch.seqlen_q, nq);
        launch.seqlen_k = std::max(launch.seqlen_k, nk);
      }
    }
    launch.total_k = row_k;
    launch.SetContiguousStrides(Layout::kBSHD);
  } else {
    launch.cu_seqlens_q = launch.cu_seqlens_k = nullptr;
    launch.SetContiguousStrides(IsBshd(first) ? Layout::kBSHD : Layout::kBHSD);
  }
  if (in_place) {
    launch.q = first.q;
    launch.k = first.k;
    launch.v = first.v;
    launch.o = first.o;
    // A lone dense request's lse [B, H, N] is the launch's.
    if (lse_in_place) launch.lse = first.lse;
  }
  // float8: q, k, v (copied in, or in place) are dequantised into q16, k16, v16, which the
  // bfloat16 kernel reads; the descales stay in `launch` for the kernel to fold in (dequantise.h).
  const void* const quantised[3] = {launch.q, launch.k, launch.v};
  if (dequantise) {
    launch.dtype = DType::kBFloat16;
    launch.q = dev.at(7);
    launch.k = dev.at(8);
    launch.v = dev.at(9);
  }
  // The kernel's own checks (sizes that fit the grid, ...) and its plan before any copy is
  // enqueued; its workspace is the one PlanFloat8 sized.
  ASSIGN_OR_RETURN(const ForwardLaunch forward, PrepareForward(launch, options_.forward_variant));
  if (forward.plan.workspace_bytes > float8.workspace_bytes) {
    return absl::InternalError(absl::StrCat("the forward plan needs ", forward.plan.workspace_bytes,
                                            " bytes of workspace; ", float8.workspace_bytes,
                                            " were reserved"));
  }

  // Inputs: each item's lines go to its place in the device buffer, from its own memory when
  // that is pinned, else through the staging buffer, where consecutive staged items form one run
  // and one DMA. Tensor by tensor, so the DMA of q overlaps the staging memcpys of k.
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
  for (int region = 0; region < 3 && !in_place; ++region) {
    const std::vector<int64_t>& first_line = region == 0 ? dev_pack.line_q : dev_pack.line_k;
    int64_t run_start = 0, run_end = 0;  // staged lines not yet sent
    for (size_t i = 0; i <= items.size(); ++i) {
      const AttentionParams* item = i < items.size() ? &items[i] : nullptr;
      const void* src = item == nullptr ? nullptr
                        : region == 0   ? item->q
                        : region == 1   ? item->k
                                        : item->v;
      const bool staged = item != nullptr && !CopiesDirectly(src, options_.device);
      if (!staged && run_end > run_start) {
        RETURN_IF_CUDA_ERROR(
            dma_in(region, run_start, host.at(region) + run_start * d * elem, run_end - run_start),
            "copy q, k, v to the device");
        run_start = run_end;
      }
      if (item == nullptr) break;
      const int64_t lines =
          region == 0 ? RowsQ(*item) * item->heads_q : RowsK(*item) * item->heads_kv;
      if (staged) {
        if (run_end == run_start) run_start = run_end = first_line[i];
        ParallelCopy(host.at(region) + first_line[i] * d * elem, src, lines * d * elem);
        run_end += lines;
      } else {
        RETURN_IF_CUDA_ERROR(dma_in(region, first_line[i], src, lines),
                             "copy q, k, v to the device");
      }
    }
  }
  if (dev_pack.varlen) {
    const size_t cu_bytes = (dev_pack.sequences + 1) * sizeof(int32_t);
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev.at(5), host.at(5), cu_bytes, cudaMemcpyHostToDevice, cs),
        "copy cu_seqlens_q to the device");
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev.at(6), host.at(6), cu_bytes, cudaMemcpyHostToDevice, cs),
        "copy cu_seqlens_k to the device");
  }
  const int64_t o_dev_bytes = dev_pack.lines_q * d8 * o_elem;
  const int64_t lse_bytes = with_lse ? dev_pack.lines_q * int64_t{sizeof(float)} : 0;
  if (options_.poison_outputs) {
    // All-ones bytes are NaN in float32, float16 and bfloat16.
    // In place, o is the client's tensor the kernel writes (launch.o).
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(launch.o, 0xff, o_dev_bytes, cs), "poison o");
    if (with_lse)
      RETURN_IF_CUDA_ERROR(cudaMemsetAsync(launch.lse, 0xff, lse_bytes, cs), "poison lse");
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[1], cs), "cudaEventRecord");
  if (dequantise) {
    const int64_t lines[3] = {dev_pack.lines_q, dev_pack.lines_k, dev_pack.lines_k};
    for (int t = 0; t < 3; ++t) {
      RETURN_IF_CUDA_ERROR(
          LaunchDequantiseE4m3ToBf16(quantised[t], dev.at(7 + t), lines[t] * d8, cs),
          "dequantise float8 q, k, v");
    }
  }
  RETURN_IF_ERROR(LaunchForward(forward, cs, stream->forward_scratch,
                                forward.plan.workspace_bytes > 0 ? dev.at(10) : nullptr));
  RETURN_IF_CUDA_ERROR(cudaEventRecord(stream->events[2], cs), "cudaEventRecord");

  // Outputs: o straight into a pinned destination, else into staging (consecutive staged items
  // in one DMA); lse always into staging (its packed layout differs from the items' when varlen).
  auto dma_out = [&](char* dst, int64_t line, int64_t lines) -> cudaError_t {
    const char* src = dev.at(3) + line * d8 * o_elem;
    return d8 == d ? cudaMemcpyAsync(dst, src, lines * d * o_elem, cudaMemcpyDefault, cs)
                   : cudaMemcpy2DAsync(dst, d * o_elem, src, d8 * o_elem, d * o_elem, lines,
                                       cudaMemcpyDefault, cs);
  };
  std::vector<bool> o_staged(items.size());
  {
    int64_t run_start = 0, run_end = 0;
    for (size_t i = 0; i <= items.size() && !in_place; ++i) {
      const bool staged = i < items.size() && !CopiesDirectly(items[i].o, options_.device);
      if (i < items.size()) o_staged[i] = staged;
      if (!staged && run_end > run_start) {
        RETURN_IF_CUDA_ERROR(
            dma_out(host.at(3) + run_start * d * o_elem, run_start, run_end - run_start),
            "copy o to the host");
        run_start = run_end;
      }
      if (i == items.size()) break;
      const int64_t lines = RowsQ(items[i]) * items[i].heads_q;
      if (staged) {
        if (run_end == run_start) run_start = run_end = dev_pack.line_q[i];
        run_end += lines;
      } else {
        RETURN_IF_CUDA_ERROR(dma_out(static_cast<char*>(items[i].o), dev_pack.line_q[i], lines),
                             "copy o to the host");
      }
    }
  }
  if (lse_to_host) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host.at(4), dev.at(4), lse_bytes, cudaMemcpyDeviceToHost, cs),
        "copy lse to the host");
  }
  for (size_t i = 0; i < items.size() && with_lse && !lse_in_place; ++i) {
    if (!lse_on_device[i]) continue;
    const auto* packed = reinterpret_cast<const float*>(dev.at(4));
    cudaError_t err = cudaSuccess;
    ForEachLsePiece(items[i], dev_pack, i,
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
  const auto* lse_packed = reinterpret_cast<const float*>(host.at(4));
  for (size_t i = 0; i < items.size(); ++i) {
    const AttentionParams& item = items[i];
    const int64_t lines = RowsQ(item) * item.heads_q;
    if (o_staged[i]) {
      ParallelCopy(item.o, host.at(3) + dev_pack.line_q[i] * d * o_elem, lines * d * o_elem);
    }
    if (!with_lse || lse_on_device[i]) continue;
    ForEachLsePiece(item, dev_pack, i,
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
  const bool copied_out = !in_place || lse_to_host;
  return HostRunTimes{in_place ? 0.0 : ms[0] * 1e3, ms[1] * 1e3,
                      copied_out ? ms[2] * 1e3 + unstage_us : 0.0};
}

}  // namespace attention::cuda
