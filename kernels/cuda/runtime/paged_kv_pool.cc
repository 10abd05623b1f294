// The CUDA backend's paged KV pool: one cudaMalloc of num_pages * page_bytes, decode steps by the
// split-KV kernels (paged_decode.h) with the step's small host arrays in a device scratch buffer
// that grows and is reused, beside the kernels' split tickets (zeroed once when allocated; each
// step leaves them zero). Calls queue their work on one stream under a mutex; a decode step waits
// for its results without it, so the next step's staging and launch overlap this one's kernel.
//
// Everything crosses the bus through pinned staging (host memory the device addresses directly):
// a Write packs the rows of all its sequences there with a table of where each (page run, K or V,
// head) goes, and one kernel (kv_scatter.h) reads both from there and scatters the rows into the
// pages; it returns with that in flight (stream order puts it before any later decode). A decode
// step packs q and its small arrays there (one copy to the device, which the kernels read many
// times), and the kernels write o and lse straight into it. A step of 8 sequences that each
// append a row thus costs 1 copy, 2 launches and one wait (the earlier designs: docs/kernels.md).
//
// A step whose tensors are in this device's memory (StepMemory::on_device: a co-located caller's
// CUDA regions) crosses no bus but for its small arrays: its rows are scattered into their pages
// straight from the caller's memory, and the kernels read q and write o and lse there in place
// (packed tensors are already in the kernels' layout; other sequences' buffers are gathered and
// scattered by device copies). With the caller's events, the stream waits for `ready` before the
// step's first read and records `done` after its last write, and the step returns once queued; with
// its counters instead, the same by stream memory operations. counter_waits.h bounds the waits for
// both (the stream waits for an event through a gate's counter, never for the event itself).
#include "kernels/cuda/runtime/paged_kv_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <iterator>
#include <mutex>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/decode/paged_decode.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/device_caps.h"
#include "kernels/cuda/ops/stream_counters.h"
#include "kernels/cuda/prep/kv_scatter.h"
#include "kernels/cuda/runtime/counter_waits.h"
#include "kernels/cuda/runtime/page_transfer.h"
#include "kernels/cuda/runtime/stream_buffers.h"
#include "kernels/paged_kv_host.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t RoundUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// One run of one write (a page's worth of rows at most): KvParts * Hkv segments, one per K or V
// head.
struct WriteRun {
  const KvWrite* write;
  int64_t page_rows;
  PageRun run;
};
// Where K (kv 0) or V (kv 1) of a write's rows are: the source, its strides (v's: VStride), bytes
// per row (D or Dv elements), and the page offset of (head, page row).
struct KvSide {
  const unsigned char* src;
  int64_t head_stride, row_stride;
  size_t row_bytes;
};
KvSide SideOf(const KvWrite& w, int kv) {
  const KvShape& shape = w.shape;
  const size_t elem = DTypeSize(shape.dtype);
  if (kv == 0) {
    return {static_cast<const unsigned char*>(w.k), w.head_stride, w.row_stride,
            shape.head_dim * elem};
  }
  return {static_cast<const unsigned char*>(w.v), VStride(shape, w.head_stride),
          VStride(shape, w.row_stride), shape.value_head_dim() * elem};
}
int64_t PageOffset(const KvShape& shape, int64_t page_rows, int kv, int64_t head, int64_t row) {
  return kv == 0 ? KvRowOffset(shape, page_rows, head, row)
                 : VRowOffset(shape, page_rows, head, row);
}
// Staged bytes of one of a run's K (kv 0) or V (kv 1) segments: its rows, rounded up to 16 for the
// next one.
size_t SegmentBytes(const WriteRun& r, int kv) {
  if (kv >= KvParts(r.write->shape)) return 0;  // V in K's rows: nothing of its own
  const size_t bytes = r.run.count * SideOf(*r.write, kv).row_bytes;
  return (bytes + 15) / 16 * 16;
}

// A step's sinks (float32 [Hq]; none: 0 bytes), staged with its small arrays.
size_t SinkBytes(const PagedDecodeParams& host) {
  return host.sinks != nullptr ? host.heads_q * sizeof(float) : 0;
}

// `host` pointed at where the kernels find its buffers: q, o and lse packed at device addresses
// (lse null: not computed), and device copies of cu_seqlens_q, seqlens_k, the page table and the
// sinks (used only when the step has sinks).
PagedDecodeParams OnDevice(const PagedDecodeParams& host, const void* q, void* o, float* lse,
                           const unsigned char* cu, const unsigned char* lens,
                           const unsigned char* table, const unsigned char* sinks) {
  PagedDecodeParams dev = host;
  dev.q = q;
  dev.o = o;
  dev.lse = lse;
  dev.q_seqs = nullptr;
  dev.o_seqs = nullptr;
  dev.lse_seqs = nullptr;
  dev.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu);
  dev.seqlens_k = reinterpret_cast<const int32_t*>(lens);
  dev.page_table = reinterpret_cast<const int32_t*>(table);
  dev.sinks = host.sinks != nullptr ? reinterpret_cast<const float*>(sinks) : nullptr;
  return dev;
}

class CudaKvPagePool : public KvPagePool {
 public:
  CudaKvPagePool(int device, const PagedPlanOptions& plan_options, int64_t num_pages,
                 int64_t page_bytes, void* pages, cudaStream_t stream, cudaEvent_t (&events)[3],
                 const CudaKvPoolOptions& options)
      : options_(options),
        plan_options_(plan_options),
        device_(device),
        num_pages_(num_pages),
        page_bytes_(page_bytes),
        pages_(static_cast<unsigned char*>(pages)),
        stream_(stream) {
    idle_events_.push_back({events[0], events[1], events[2]});
  }
  ~CudaKvPagePool() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    // scratch_, tickets_ and staging_ go with the pool (GrowableBuffer).
    cudaFree(pages_);
    for (const StepEvents& set : idle_events_) DestroyEvents(set);
    cudaStreamDestroy(stream_);
  }

  int64_t page_bytes() const override { return page_bytes_; }
  int64_t num_pages() const override { return num_pages_; }

  // The writes' rows are gathered into pinned staging, one segment per (page run, K or V, head):
  // its rows, packed, are contiguous in the page. Runs are taken in chunks of up to
  // kWriteChunkBytes (at least a run); each chunk is one copy of its rows and segment table to the
  // device scratch and one scatter launch (kv_scatter.h). A step's new tokens thus cost two calls,
  // however many sequences it appends to.
  absl::Status Write(absl::Span<const KvWrite> writes) override {
    std::vector<WriteRun> runs;
    for (const KvWrite& w : writes) {
      ASSIGN_OR_RETURN(const int64_t page_rows, CheckKvWrite(w, page_bytes_, num_pages_));
      RETURN_IF_ERROR(ForEachPageRun(w, page_rows, [&](const PageRun& run) {
        runs.push_back({&w, page_rows, run});
        return absl::OkStatus();
      }));
    }
    if (runs.empty()) return absl::OkStatus();
    std::unique_lock<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const void* waited = nullptr;  // a Step's writes share its event or counter: one wait
    for (const KvWrite& w : writes) {
      if (ReadyKey(w.memory) == waited) continue;
      RETURN_IF_ERROR(WaitReady(w.memory));
      waited = ReadyKey(w.memory);
    }
    // Rows in this device's memory need no staging of their bytes: their own chunks.
    std::vector<WriteRun> device_runs;
    const auto on_device = std::stable_partition(
        runs.begin(), runs.end(), [](const WriteRun& r) { return !r.write->memory.on_device; });
    device_runs.assign(on_device, runs.end());
    runs.erase(on_device, runs.end());
    absl::Status status = WriteFromDevice(device_runs, lock);
    for (size_t first = 0; first < runs.size() && status.ok();) {
      // Runs [first, last): their segments' rows, then the segment table.
      size_t last = first, segments = 0, data_bytes = 0;
      while (last < runs.size()) {
        const WriteRun& r = runs[last];
        const size_t bytes = r.write->shape.heads_kv * (SegmentBytes(r, 0) + SegmentBytes(r, 1));
        if (last > first && data_bytes + bytes > kWriteChunkBytes) break;
        data_bytes += bytes;
        segments += KvParts(r.write->shape) * r.write->shape.heads_kv;
        ++last;
      }
      status = WriteChunk(absl::MakeConstSpan(runs).subspan(first, last - first), data_bytes,
                          segments, lock);
      first = last;
    }
    if (!status.ok()) cudaStreamSynchronize(stream_);
    // The rows are staged: the caller may reuse its buffers at once.
    return status;
  }

  // One device-to-device copy per page on the pool's stream, so stream order puts each after the
  // writes queued before it and before every later write and decode step. Returns with the copies
  // queued (as Write); they read no staging, so they do not count in enqueued_.
  absl::Status CopyPages(absl::Span<const std::pair<int32_t, int32_t>> src_dst) override {
    RETURN_IF_ERROR(CheckPageCopies(src_dst, num_pages_));
    if (src_dst.empty()) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    for (const auto& [src, dst] : src_dst) {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(pages_ + dst * page_bytes_, pages_ + src * page_bytes_,
                                           page_bytes_, cudaMemcpyDeviceToDevice, stream_),
                           "copy a KV page on the device");
    }
    return absl::OkStatus();
  }

  // One 2D copy per (page run, K or V, head) from the page (its rows contiguous) to the host rows
  // (row_stride apart) on the pool's stream, so stream order puts them after every write queued
  // before; returns once they are on the host. An export's path, not a step's: no staging.
  absl::Status Read(const KvRead& read) override {
    const KvWrite w = AsKvWrite(read);
    ASSIGN_OR_RETURN(const int64_t page_rows, CheckKvWrite(w, page_bytes_, num_pages_));
    const KvShape& shape = read.shape;
    const size_t elem = DTypeSize(shape.dtype);
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    RETURN_IF_ERROR(ForEachPageRun(w, page_rows, [&](const PageRun& run) -> absl::Status {
      const unsigned char* page = pages_ + run.page * page_bytes_;
      for (int kv = 0; kv < KvParts(shape); ++kv) {
        const KvSide side = SideOf(w, kv);  // its src: where the rows go on the host
        for (int64_t h = 0; h < shape.heads_kv; ++h) {
          const int64_t at = (h * side.head_stride + run.src_row * side.row_stride) * elem;
          RETURN_IF_CUDA_ERROR(
              cudaMemcpy2DAsync(const_cast<unsigned char*>(side.src) + at, side.row_stride * elem,
                                page + PageOffset(shape, page_rows, kv, h, run.page_row),
                                side.row_bytes, side.row_bytes, run.count, cudaMemcpyDeviceToHost,
                                stream_),
              "copy KV rows from the device");
        }
      }
      return absl::OkStatus();
    }));
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "read KV rows from the device");
    return absl::OkStatus();
  }

  // The host tier (page_transfer.h): pinned memory, copies on the pool's stream under its lock.
  absl::StatusOr<HostBuffer> AllocateHost(int64_t bytes) override {
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    return AllocatePinnedHost(bytes);
  }
  absl::Status SavePages(absl::Span<const HostPage> pages) override {
    return CopyHost(pages, /*to_host=*/true);
  }
  absl::Status LoadPages(absl::Span<const HostPage> pages) override {
    return CopyHost(pages, /*to_host=*/false);
  }
  absl::Status CopyHost(absl::Span<const HostPage> pages, bool to_host) {
    RETURN_IF_ERROR(CheckHostPages(pages, num_pages_));
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    return CopyHostPages(stream_, pages_, page_bytes_, pages, to_host);
  }

  absl::StatusOr<KvStepTimes> Decode(const PagedDecodeParams& host) override {
    ASSIGN_OR_RETURN(const DecodeExtent extent, CheckPagedDecode(host, page_bytes_, num_pages_));
    if (host.num_seqs == 0 || host.total_q == 0) return KvStepTimes{};
    ASSIGN_OR_RETURN(const PagedDecodePlan plan, PlanPagedDecode(host, extent, plan_options_));

    if (host.memory.on_device) return DecodeOnDevice(host, plan, extent);

    std::unique_lock<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const size_t elem = DTypeSize(host.shape.dtype);
    const size_t q_bytes = host.heads_q * host.total_q * host.shape.head_dim * elem;
    const size_t o_bytes = host.heads_q * host.total_q * host.shape.value_head_dim() * elem;
    const bool lse = DecodeWantsLse(host);
    const size_t lse_bytes = lse ? host.heads_q * host.total_q * sizeof(float) : 0;
    const size_t cu_bytes = (host.num_seqs + 1) * sizeof(int32_t);
    const size_t lens_bytes = host.num_seqs * sizeof(int32_t);
    const size_t table_bytes = host.num_seqs * host.page_table_stride * sizeof(int32_t);
    // Staging: the inputs q | cu_seqlens_q | seqlens_k | page_table | sinks, then the outputs o |
    // lse. Scratch: the inputs laid out the same (one copy from staging), then the kernels'
    // workspace.
    StepLayout l;
    const size_t sizes[kEnd] = {q_bytes,         cu_bytes, lens_bytes, table_bytes,
                                SinkBytes(host), o_bytes,  lse_bytes};
    for (int i = 0; i < kEnd; ++i) l.offsets[i + 1] = l.offsets[i] + RoundUp(sizes[i]);
    RETURN_IF_ERROR(Reserve(l.offsets[kO] + plan.workspace_bytes));
    RETURN_IF_ERROR(ReserveTickets(plan.tickets));
    ASSIGN_OR_RETURN(l.staged, Stage(l.offsets[kEnd], lock));
    GatherDecodeQ(host, l.staged + l.offsets[kQ]);
    const void* arrays[] = {host.cu_seqlens_q, host.seqlens_k, host.page_table, host.sinks};
    for (int i = kCu; i <= kSinks; ++i) {
      if (sizes[i] > 0) std::memcpy(l.staged + l.offsets[i], arrays[i - kCu], sizes[i]);
    }
    ASSIGN_OR_RETURN(const StepEvents events, TakeEvents());

    // The step's staging holds its outputs until it has read them (Stage waits for that before it
    // starts from the front again). The wait runs without the lock, so the next step's staging and
    // launch overlap this one's kernel on the stream.
    ++staged_readers_;
    absl::Status status = Enqueue(plan, extent, host, l, events);
    const uint64_t mine = ++enqueued_;
    KvStepTimes times;
    if (status.ok()) {
      lock.unlock();
      status = CudaStatus(cudaEventSynchronize(events[2]), "run the decode step on the device");
      if (status.ok()) {
        ScatterDecodeOutputs(host, l.staged + l.offsets[kO],
                             reinterpret_cast<const float*>(l.staged + l.offsets[kLse]));
        // The outputs' writes are the kernels': d2h_us stays 0.
        status = ReadTimes(events, &times);
      }
      lock.lock();
    } else {
      cudaStreamSynchronize(stream_);
    }
    --staged_readers_;
    idle_events_.push_back(events);
    if (staged_readers_ == 0) {
      readers_done_.notify_all();
      // This step's copy-out was the stream's last work and nobody reads staging: the next call
      // stages from the front (a lone caller reuses the same warm staging every step).
      if (status.ok() && enqueued_ == mine) staging_used_ = 0;
    }
    if (!status.ok()) return status;
    return times;
  }

 private:
  // The stream waits for the caller's `ready` event, when it sent one. Under mu_.
  absl::Status WaitReady(const StepMemory& memory) {
    if (memory.ready_counter != nullptr) {
      return counter_waits_.Wait(stream_, memory.ready_counter, memory.ready_value);
    }
    if (memory.ready == nullptr) return absl::OkStatus();
    return counter_waits_.WaitEvent(stream_, static_cast<cudaEvent_t>(memory.ready));
  }
  // What a step's stream waits on (its ready event or counter): a Step's writes share it.
  static const void* ReadyKey(const StepMemory& memory) {
    return memory.ready_counter != nullptr ? static_cast<const void*>(memory.ready_counter)
                                           : memory.ready;
  }

  // Rows in this device's memory scattered straight from there: a segment per (page run, K or V,
  // head) when a head's rows are contiguous (row_stride == D, as in [Hkv, n, D]), else one per
  // row; the table staged, in chunks of what fits a quarter of the staging. Sources are offsets
  // from the lowest address of the chunk. Under mu_ (`lock`).
  absl::Status WriteFromDevice(absl::Span<const WriteRun> runs,
                               std::unique_lock<std::mutex>& lock) {
    std::vector<std::pair<const unsigned char*, KvSegment>> segments;  // (source, its segment)
    int unit = 16;
    for (const WriteRun& r : runs) {
      const KvWrite& w = *r.write;
      const KvShape& shape = w.shape;
      const size_t elem = DTypeSize(shape.dtype);
      const bool contiguous = w.row_stride == shape.head_dim;  // v's then Dv (VStride)
      for (int kv = 0; kv < KvParts(shape); ++kv) {
        const KvSide side = SideOf(w, kv);
        const int64_t row_bytes = static_cast<int64_t>(side.row_bytes);
        unit = std::gcd(unit, static_cast<int>(row_bytes));
        for (int64_t h = 0; h < shape.heads_kv; ++h) {
          const int64_t dst =
              r.run.page * page_bytes_ + PageOffset(shape, r.page_rows, kv, h, r.run.page_row);
          for (int64_t j = 0; j < (contiguous ? 1 : r.run.count); ++j) {
            const unsigned char* from =
                side.src + (h * side.head_stride + (r.run.src_row + j) * side.row_stride) * elem;
            unit = std::gcd(unit, static_cast<int>(reinterpret_cast<uintptr_t>(from) % 16));
            segments.push_back({from, KvSegment{0, dst + j * row_bytes,
                                                (contiguous ? r.run.count : 1) * row_bytes}});
          }
        }
      }
    }
    constexpr size_t kPerChunk = kWriteChunkBytes / sizeof(KvSegment);
    for (size_t first = 0; first < segments.size(); first += kPerChunk) {
      const size_t count = std::min(kPerChunk, segments.size() - first);
      const auto chunk = absl::MakeConstSpan(segments).subspan(first, count);
      const unsigned char* base =
          std::min_element(chunk.begin(), chunk.end(), [](const auto& a, const auto& b) {
            return a.first < b.first;
          })->first;
      ASSIGN_OR_RETURN(unsigned char* const staged, Stage(count * sizeof(KvSegment), lock));
      auto* table = reinterpret_cast<KvSegment*>(staged);
      for (size_t i = 0; i < count; ++i) {
        table[i] = chunk[i].second;
        table[i].src = chunk[i].first - base;
      }
      RETURN_IF_CUDA_ERROR(
          LaunchKvScatter(table, static_cast<int64_t>(count), base, pages_, unit, stream_),
          "scatter kv rows into their pages");
      ++enqueued_;
    }
    return absl::OkStatus();
  }

  // A decode step whose q, o and lse are in this device's memory: the kernels read q and write o
  // and lse in place when each is packed already (sequence s's rows at Hq * cu_seqlens_q[s] rows
  // from the first's, as a packed Step's tensors are), else through the scratch by one device
  // copy per sequence. Only the small arrays cross the bus. With the caller's `done` event it
  // returns once queued (times 0).
  absl::StatusOr<KvStepTimes> DecodeOnDevice(const PagedDecodeParams& host,
                                             const PagedDecodePlan& plan,
                                             const DecodeExtent& extent) {
    std::unique_lock<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    // Bytes per query row of q (D) and of o (Dv).
    const size_t row_bytes = host.heads_q * host.shape.head_dim * DTypeSize(host.shape.dtype);
    const size_t o_row_bytes =
        host.heads_q * host.shape.value_head_dim() * DTypeSize(host.shape.dtype);
    const size_t lse_row_bytes = host.heads_q * sizeof(float);
    const bool lse = DecodeWantsLse(host);
    // The start of the step's buffers of `bytes_per_row` per query row when they are one packed
    // tensor (sequence s's at cu_seqlens_q[s] rows from the first's) whose start the kernels'
    // 16-byte accesses may use; null when not.
    auto packed = [&](const void* const* seqs, const void* whole,
                      size_t bytes_per_row) -> const unsigned char* {
      const auto* first = static_cast<const unsigned char*>(seqs != nullptr ? seqs[0] : whole);
      if (reinterpret_cast<uintptr_t>(first) % 16 != 0) return nullptr;
      if (seqs == nullptr) return first;
      for (int64_t s = 1; s < host.num_seqs; ++s) {
        if (static_cast<const unsigned char*>(seqs[s]) !=
            first + host.cu_seqlens_q[s] * bytes_per_row) {
          return nullptr;
        }
      }
      return first;
    };
    const unsigned char* q = packed(host.q_seqs, host.q, row_bytes);
    auto* o = const_cast<unsigned char*>(
        packed(reinterpret_cast<const void* const*>(host.o_seqs), host.o, o_row_bytes));
    auto* lse_at =
        lse ? const_cast<unsigned char*>(packed(reinterpret_cast<const void* const*>(host.lse_seqs),
                                                host.lse, lse_row_bytes))
            : nullptr;
    // Scratch: cu_seqlens_q | seqlens_k | page_table | sinks (copied from staging), then q, o and
    // lse where they are not packed, then the kernels' workspace.
    enum { kCu, kLens, kTable, kSinks, kQ, kO, kLse, kWork };
    const size_t sizes[kWork] = {(host.num_seqs + 1) * sizeof(int32_t),
                                 host.num_seqs * sizeof(int32_t),
                                 host.num_seqs * host.page_table_stride * sizeof(int32_t),
                                 SinkBytes(host),
                                 q != nullptr ? 0 : host.total_q * row_bytes,
                                 o != nullptr ? 0 : host.total_q * o_row_bytes,
                                 lse && lse_at == nullptr ? host.total_q * lse_row_bytes : 0};
    size_t offsets[kWork + 1] = {0};
    for (int i = 0; i < kWork; ++i) offsets[i + 1] = offsets[i] + RoundUp(sizes[i]);
    RETURN_IF_ERROR(Reserve(offsets[kWork] + plan.workspace_bytes));
    RETURN_IF_ERROR(ReserveTickets(plan.tickets));
    ASSIGN_OR_RETURN(unsigned char* const staged, Stage(offsets[kQ], lock));
    const void* arrays[] = {host.cu_seqlens_q, host.seqlens_k, host.page_table, host.sinks};
    for (int i = kCu; i <= kSinks; ++i) {
      if (sizes[i] > 0) std::memcpy(staged + offsets[i], arrays[i], sizes[i]);
    }
    auto at = [&](int i) { return scratch_.data() + offsets[i]; };
    ASSIGN_OR_RETURN(const StepEvents events, TakeEvents());
    absl::Status status = [&]() -> absl::Status {
      RETURN_IF_ERROR(WaitReady(host.memory));
      RETURN_IF_CUDA_ERROR(cudaEventRecord(events[0], stream_), "cudaEventRecord");
      RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(at(kCu), staged, offsets[kQ], cudaMemcpyHostToDevice, stream_),
          "copy the decode step's arrays to the device");
      // One device copy per sequence, each way, for buffers that are not packed.
      auto copy_rows = [&](unsigned char* packed_at, const void* const* seqs, size_t bytes_per_row,
                           bool to_packed) -> absl::Status {
        for (int64_t s = 0; s < host.num_seqs; ++s) {
          const int64_t first = host.cu_seqlens_q[s], rows = host.cu_seqlens_q[s + 1] - first;
          if (rows == 0) continue;
          unsigned char* in_packed = packed_at + first * bytes_per_row;
          RETURN_IF_CUDA_ERROR(
              cudaMemcpyAsync(to_packed ? in_packed : const_cast<void*>(seqs[s]),
                              to_packed ? seqs[s] : in_packed, rows * bytes_per_row,
                              cudaMemcpyDeviceToDevice, stream_),
              "copy a sequence's rows on the device");
        }
        return absl::OkStatus();
      };
      if (q == nullptr) {
        RETURN_IF_ERROR(copy_rows(at(kQ), host.q_seqs, row_bytes, true));
      }
      const PagedDecodeParams dev =
          OnDevice(host, q != nullptr ? q : at(kQ), o != nullptr ? o : at(kO),
                   !lse ? nullptr : reinterpret_cast<float*>(lse_at != nullptr ? lse_at : at(kLse)),
                   at(kCu), at(kLens), at(kTable), at(kSinks));
      if (options_.poison_outputs) {
        // As the host path's: all-ones bytes are NaN in every dtype. Where the caller gave each
        // sequence's rows, one memset per sequence: rows found packed may still lie in separate
        // allocations that happen to abut, which the kernels' stores may cross but a memset not.
        auto poison = [&](void* whole, const void* const* seqs, size_t bytes_per_row,
                          bool in_scratch, const char* what) -> absl::Status {
          if (seqs == nullptr || in_scratch) {
            RETURN_IF_CUDA_ERROR(
                cudaMemsetAsync(whole, 0xff, host.total_q * bytes_per_row, stream_), what);
            return absl::OkStatus();
          }
          for (int64_t s = 0; s < host.num_seqs; ++s) {
            const int64_t rows = host.cu_seqlens_q[s + 1] - host.cu_seqlens_q[s];
            if (rows == 0) continue;
            RETURN_IF_CUDA_ERROR(
                cudaMemsetAsync(const_cast<void*>(seqs[s]), 0xff, rows * bytes_per_row, stream_),
                what);
          }
          return absl::OkStatus();
        };
        RETURN_IF_ERROR(poison(dev.o, reinterpret_cast<const void* const*>(host.o_seqs),
                               o_row_bytes, o == nullptr, "poison o"));
        if (lse) {
          RETURN_IF_ERROR(poison(dev.lse, reinterpret_cast<const void* const*>(host.lse_seqs),
                                 lse_row_bytes, lse_at == nullptr, "poison lse"));
        }
      }
      RETURN_IF_CUDA_ERROR(cudaEventRecord(events[1], stream_), "cudaEventRecord");
      RETURN_IF_ERROR(LaunchPagedDecode(plan, pages_, page_bytes_, extent, dev, at(kWork),
                                        reinterpret_cast<int32_t*>(tickets_.data()), stream_));
      if (o == nullptr) {
        RETURN_IF_ERROR(copy_rows(at(kO), reinterpret_cast<const void* const*>(host.o_seqs),
                                  o_row_bytes, false));
      }
      if (lse && lse_at == nullptr) {
        RETURN_IF_ERROR(copy_rows(at(kLse), reinterpret_cast<const void* const*>(host.lse_seqs),
                                  lse_row_bytes, false));
      }
      RETURN_IF_CUDA_ERROR(cudaEventRecord(events[2], stream_), "cudaEventRecord");
      if (host.memory.done != nullptr) {
        RETURN_IF_CUDA_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(host.memory.done), stream_),
                             "record the caller's done_event");
      }
      if (host.memory.done_counter != nullptr) {
        RETURN_IF_ERROR(WriteCounter(stream_, host.memory.done_counter, host.memory.done_value));
      }
      return absl::OkStatus();
    }();
    ++enqueued_;
    KvStepTimes times;
    if (status.ok() && !host.memory.stream_ordered()) {
      // No event of the caller's: the step answers once its outputs are written.
      lock.unlock();
      status = CudaStatus(cudaEventSynchronize(events[2]), "run the decode step on the device");
      if (status.ok()) status = ReadTimes(events, &times);
      lock.lock();
    } else if (!status.ok()) {
      cudaStreamSynchronize(stream_);
    }
    idle_events_.push_back(events);
    if (!status.ok()) return status;
    return times;
  }

  // Where a decode step's buffers lie: offsets of q | cu_seqlens_q | seqlens_k | page_table |
  // sinks | o | lse in the step's staging; the device scratch holds the inputs at the same offsets,
  // then the workspace (at offsets[kO]).
  enum { kQ, kCu, kLens, kTable, kSinks, kO, kLse, kEnd };
  struct StepLayout {
    size_t offsets[kEnd + 1] = {0};
    unsigned char* staged = nullptr;
  };
  // Before the h2d copy, before the kernels, after them.
  using StepEvents = std::array<cudaEvent_t, 3>;

  // Queues a staged step: its inputs' copy and the kernels, which write o and lse into its
  // staging, with the events around them. Under mu_.
  absl::Status Enqueue(const PagedDecodePlan& plan, const DecodeExtent& extent,
                       const PagedDecodeParams& host, const StepLayout& l,
                       const StepEvents& events) {
    auto at = [&](int i) { return scratch_.data() + l.offsets[i]; };
    const bool lse = DecodeWantsLse(host);
    const PagedDecodeParams dev =
        OnDevice(host, at(kQ), l.staged + l.offsets[kO],
                 lse ? reinterpret_cast<float*>(l.staged + l.offsets[kLse]) : nullptr, at(kCu),
                 at(kLens), at(kTable), at(kSinks));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events[0], stream_), "cudaEventRecord");
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(at(kQ), l.staged, l.offsets[kO], cudaMemcpyHostToDevice, stream_),
        "copy the decode step's inputs to the device");
    if (options_.poison_outputs) {
      // All-ones bytes are NaN in every dtype: an element the kernels miss shows instead of a
      // value left from an earlier step. The step's staging is its own until it has read it.
      std::memset(l.staged + l.offsets[kO], 0xff, l.offsets[kEnd] - l.offsets[kO]);
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events[1], stream_), "cudaEventRecord");
    RETURN_IF_ERROR(LaunchPagedDecode(plan, pages_, page_bytes_, extent, dev, at(kO),
                                      reinterpret_cast<int32_t*>(tickets_.data()), stream_));
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events[2], stream_), "cudaEventRecord");
    return absl::OkStatus();
  }

  // A finished step's times: its inputs' copy (events 0 to 1) and its kernels (1 to 2).
  static absl::Status ReadTimes(const StepEvents& events, KvStepTimes* times) {
    double* us[2] = {&times->h2d_us, &times->compute_us};
    for (int i = 0; i < 2; ++i) {
      float ms = 0;
      RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, events[i], events[i + 1]),
                           "cudaEventElapsedTime");
      *us[i] = ms * 1e3;
    }
    return absl::OkStatus();
  }

  // An idle set of step events (created when none is idle). Under mu_.
  absl::StatusOr<StepEvents> TakeEvents() {
    if (!idle_events_.empty()) {
      const StepEvents events = idle_events_.back();
      idle_events_.pop_back();
      return events;
    }
    StepEvents events;
    RETURN_IF_ERROR(CreateEvents(absl::MakeSpan(events)));
    return events;
  }

  // Stages the runs' rows (data_bytes, a multiple of 16) and their segment table (`segments`
  // entries) after them, and scatters the rows into their pages by a kernel that reads both there.
  // In units of the largest power of two up to 16 that divides every row's bytes (every offset in a
  // page is a multiple of a row).
  absl::Status WriteChunk(absl::Span<const WriteRun> runs, size_t data_bytes, size_t segments,
                          std::unique_lock<std::mutex>& lock) {
    const size_t bytes = data_bytes + segments * sizeof(KvSegment);
    ASSIGN_OR_RETURN(unsigned char* const staged, Stage(bytes, lock));
    auto* table = reinterpret_cast<KvSegment*>(staged + data_bytes);
    size_t at = 0, n = 0;
    int unit = 16;
    for (const WriteRun& r : runs) {
      const KvWrite& w = *r.write;
      const KvShape& shape = w.shape;
      const size_t elem = DTypeSize(shape.dtype);
      for (int kv = 0; kv < KvParts(shape); ++kv) {
        const KvSide side = SideOf(w, kv);
        const size_t row_bytes = side.row_bytes;
        unit = std::gcd(unit, static_cast<int>(row_bytes));
        for (int64_t h = 0; h < shape.heads_kv; ++h) {
          for (int64_t j = 0; j < r.run.count; ++j) {
            std::memcpy(
                staged + at + j * row_bytes,
                side.src + (h * side.head_stride + (r.run.src_row + j) * side.row_stride) * elem,
                row_bytes);
          }
          table[n++] = {
              static_cast<int64_t>(at),
              r.run.page * page_bytes_ + PageOffset(shape, r.page_rows, kv, h, r.run.page_row),
              static_cast<int64_t>(r.run.count * row_bytes)};
          at += SegmentBytes(r, kv);
        }
      }
    }
    RETURN_IF_CUDA_ERROR(
        LaunchKvScatter(table, static_cast<int64_t>(segments), staged, pages_, unit, stream_),
        "scatter kv rows into their pages");
    ++enqueued_;
    return absl::OkStatus();
  }

  // `bytes` of pinned staging, after what earlier calls staged and may still be copying from or
  // reading. When the rest is short, waits until no decode step has its outputs there still to
  // read and the stream is done with every copy, and starts from the front again, first growing
  // the buffer when `bytes` exceeds it. `lock` holds mu_ (released while waiting for readers).
  absl::StatusOr<unsigned char*> Stage(size_t bytes, std::unique_lock<std::mutex>& lock) {
    bytes = RoundUp(bytes);
    if (staging_used_ + bytes > staging_.bytes()) {
      readers_done_.wait(lock, [this] { return staged_readers_ == 0; });
      RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      staging_used_ = 0;
      if (bytes > staging_.bytes()) {
        RETURN_IF_ERROR(staging_.Grow(std::max<size_t>(bytes, kMinStagingBytes), "KV staging"));
      }
    }
    unsigned char* at = staging_.data() + staging_used_;
    staging_used_ += bytes;
    return at;
  }

  // Grows the scratch buffer to at least `bytes`.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= scratch_.bytes()) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return scratch_.Grow(bytes, "decode scratch");
  }

  // Grows the split tickets to at least `count`, zeroed (the kernels leave them zero).
  absl::Status ReserveTickets(int64_t count) {
    const size_t bytes = count * sizeof(int32_t);
    if (bytes <= tickets_.bytes()) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    RETURN_IF_ERROR(tickets_.Grow(bytes, "decode split tickets"));
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(tickets_.data(), 0, bytes, stream_),
                         "zero the split tickets");
    return absl::OkStatus();
  }

  const CudaKvPoolOptions options_;
  const PagedPlanOptions plan_options_;  // the device's, with options_.splits
  const int device_;
  const int64_t num_pages_, page_bytes_;
  unsigned char* const pages_;
  std::mutex mu_;
  cudaStream_t stream_;
  std::vector<StepEvents> idle_events_;  // one set per step in flight, reused
  // Decode steps queued whose outputs in staging are still to be read (Stage waits for none).
  int staged_readers_ = 0;
  std::condition_variable readers_done_;
  uint64_t enqueued_ = 0;  // work queued on the stream so far (Write chunks, decode steps)
  GrowableBuffer scratch_{GrowableBuffer::Kind::kDevice};
  // Pinned host staging (Stage); the front staging_used_ bytes may still be in flight.
  static constexpr size_t kMinStagingBytes = size_t{16} << 20;
  // Rows per copy and scatter of a Write (a quarter of the staging: packing the next chunk overlaps
  // the copy of the last).
  static constexpr size_t kWriteChunkBytes = kMinStagingBytes / 4;
  GrowableBuffer staging_{GrowableBuffer::Kind::kPinned};
  size_t staging_used_ = 0;
  GrowableBuffer tickets_{GrowableBuffer::Kind::kDevice};  // int32 split tickets
  // Last: its watcher ends the waits (counters and events) the destructor's synchronisation would
  // otherwise hang on.
  CounterWaits counter_waits_{device_, options_.stream_wait_timeout};
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeKvPagePool(int device, int64_t num_pages,
                                                           int64_t page_bytes,
                                                           const CudaKvPoolOptions& options) {
  if (num_pages <= 0 || page_bytes <= 0 || page_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_pages must be positive and page_bytes a positive multiple of 16 (16-byte loads), "
        "got ",
        num_pages, " and ", page_bytes));
  }
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
  ASSIGN_OR_RETURN(const DeviceCaps caps, GetDeviceCaps(device));
  // The cluster merge is in the kernels' sm_90a code only, which runs on compute capability 9.0
  // alone (other GPUs run the sm_80 code, or JIT its PTX).
  constexpr int kClusterCapability = 90;
  const PagedPlanOptions plan_options = {
      .sm_count = caps.sm_count,
      .splits = options.splits,
      .clusters = caps.compute_capability == kClusterCapability && options.clusters,
      .smem_per_block = caps.smem_per_block_optin};
  const size_t bytes = static_cast<size_t>(num_pages) * page_bytes;
  void* pages = nullptr;
  if (cudaError_t err = cudaMalloc(&pages, bytes); err != cudaSuccess) {
    return CudaError(
        err, absl::StrCat("cannot allocate ", bytes, " bytes of device memory for the KV pool"));
  }
  absl::StatusOr<cudaStream_t> stream = CreateStream();
  if (!stream.ok()) {
    cudaFree(pages);
    return stream.status();
  }
  cudaEvent_t events[3];
  if (absl::Status created = CreateEvents(events); !created.ok()) {
    cudaStreamDestroy(*stream);
    cudaFree(pages);
    return created;
  }
  return std::unique_ptr<KvPagePool>(new CudaKvPagePool(device, plan_options, num_pages, page_bytes,
                                                        pages, *stream, events, options));
}

}  // namespace attention::cuda
