// The CUDA backend's paged KV pool: one cudaMalloc of num_pages * page_bytes, writes by
// cudaMemcpy2DAsync from host rows into pages, decode steps by the split-KV kernels
// (paged_decode.h) with the step's small host arrays staged through a device scratch buffer that
// grows and is reused, beside the kernels' split tickets (zeroed once when allocated; each step
// leaves them zero). Calls are serialised on one stream (std::mutex).
#include "kernels/cuda/paged_kv_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/host_runner.h"
#include "kernels/cuda/paged_decode.h"
#include "kernels/paged_kv_host.h"

namespace attention::cuda {
namespace {

#define RETURN_IF_CUDA_ERROR(expr, what)                  \
  do {                                                    \
    if (cudaError_t err_ = (expr); err_ != cudaSuccess) { \
      return CudaError(err_, what);                       \
    }                                                     \
  } while (0)

constexpr size_t kAlign = 256;
size_t RoundUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

absl::Status AllocationError(size_t bytes, const char* what, cudaError_t err) {
  cudaGetLastError();  // clear the (non-sticky) allocation error
  return absl::ResourceExhaustedError(absl::StrCat("cuda backend: cannot allocate ", bytes,
                                                   " bytes of device memory for ", what, ": ",
                                                   cudaGetErrorName(err)));
}

class CudaKvPagePool : public KvPagePool {
 public:
  CudaKvPagePool(int device, int sm_count, int64_t num_pages, int64_t page_bytes, void* pages,
                 cudaStream_t stream, cudaEvent_t (&events)[4], const CudaKvPoolOptions& options)
      : options_(options),
        device_(device),
        sm_count_(sm_count),
        num_pages_(num_pages),
        page_bytes_(page_bytes),
        pages_(static_cast<unsigned char*>(pages)),
        stream_(stream) {
    std::copy(std::begin(events), std::end(events), events_);
  }
  ~CudaKvPagePool() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaFree(scratch_);
    cudaFree(tickets_);
    cudaFree(pages_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }

  int64_t page_bytes() const override { return page_bytes_; }
  int64_t num_pages() const override { return num_pages_; }

  absl::Status Write(const KvWrite& w) override {
    absl::StatusOr<int64_t> page_rows = CheckKvWrite(w, page_bytes_, num_pages_);
    if (!page_rows.ok()) return page_rows.status();
    if (w.rows == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const KvShape& shape = w.shape;
    const size_t elem = DTypeSize(shape.dtype);
    const size_t row_bytes = shape.head_dim * elem;
    const int64_t v_offset = VOffset(shape, *page_rows);
    absl::Status status = ForEachPageRun(w, *page_rows, [&](const PageRun& run) {
      unsigned char* page = pages_ + run.page * page_bytes_;
      for (int kv = 0; kv < 2; ++kv) {
        const auto* src = static_cast<const unsigned char*>(kv == 0 ? w.k : w.v) +
                          run.src_row * w.row_stride * elem;
        unsigned char* dst =
            page + KvRowOffset(shape, *page_rows, 0, run.page_row) + (kv == 0 ? 0 : v_offset);
        // Fewer copies of more lines: one per head over the run's rows, or (a run shorter than
        // the heads, e.g. one decoded row) one per row over the heads.
        if (run.count >= shape.heads_kv) {
          for (int64_t h = 0; h < shape.heads_kv; ++h) {
            RETURN_IF_CUDA_ERROR(
                cudaMemcpy2DAsync(dst + h * *page_rows * row_bytes, row_bytes,
                                  src + h * w.head_stride * elem, w.row_stride * elem, row_bytes,
                                  run.count, cudaMemcpyHostToDevice, stream_),
                "copy kv rows to the device");
          }
        } else {
          for (int64_t j = 0; j < run.count; ++j) {
            RETURN_IF_CUDA_ERROR(
                cudaMemcpy2DAsync(dst + j * row_bytes, *page_rows * row_bytes,
                                  src + j * w.row_stride * elem, w.head_stride * elem, row_bytes,
                                  shape.heads_kv, cudaMemcpyHostToDevice, stream_),
                "copy kv rows to the device");
          }
        }
      }
      return absl::OkStatus();
    });
    if (!status.ok()) {
      cudaStreamSynchronize(stream_);
      return status;
    }
    // The caller may reuse its rows once Write returns.
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "copy kv rows to the device");
    return absl::OkStatus();
  }

  absl::StatusOr<KvStepTimes> Decode(const PagedDecodeParams& host) override {
    absl::StatusOr<DecodeExtent> extent = CheckPagedDecode(host, page_bytes_, num_pages_);
    if (!extent.ok()) return extent.status();
    if (host.num_seqs == 0 || host.total_q == 0) return KvStepTimes{};
    absl::StatusOr<PagedDecodePlan> plan = PlanPagedDecode(host, *extent, {.sm_count = sm_count_});
    if (!plan.ok()) return plan.status();

    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const size_t elem = DTypeSize(host.shape.dtype);
    const size_t q_bytes = host.heads_q * host.total_q * host.shape.head_dim * elem;
    const size_t lse_bytes = host.lse ? host.heads_q * host.total_q * sizeof(float) : 0;
    const size_t cu_bytes = (host.num_seqs + 1) * sizeof(int32_t);
    const size_t lens_bytes = host.num_seqs * sizeof(int32_t);
    const size_t table_bytes = host.num_seqs * host.page_table_stride * sizeof(int32_t);
    // Scratch: q | o | lse | cu_seqlens_q | seqlens_k | page_table | workspace.
    const size_t sizes[7] = {
        q_bytes, q_bytes, lse_bytes, cu_bytes, lens_bytes, table_bytes, plan->workspace_bytes};
    size_t offsets[8] = {0};
    for (int i = 0; i < 7; ++i) offsets[i + 1] = offsets[i] + RoundUp(sizes[i]);
    if (absl::Status s = Reserve(offsets[7]); !s.ok()) return s;
    if (absl::Status s = ReserveTickets(plan->tickets); !s.ok()) return s;
    auto at = [&](int i) { return scratch_ + offsets[i]; };

    PagedDecodeParams dev = host;
    dev.q = at(0);
    dev.o = at(1);
    dev.lse = host.lse ? reinterpret_cast<float*>(at(2)) : nullptr;
    dev.cu_seqlens_q = reinterpret_cast<const int32_t*>(at(3));
    dev.seqlens_k = reinterpret_cast<const int32_t*>(at(4));
    dev.page_table = reinterpret_cast<const int32_t*>(at(5));

    RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[0], stream_), "cudaEventRecord");
    const std::pair<const void*, int> inputs[] = {
        {host.q, 0}, {host.cu_seqlens_q, 3}, {host.seqlens_k, 4}, {host.page_table, 5}};
    for (const auto& [src, i] : inputs) {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(at(i), src, sizes[i], cudaMemcpyHostToDevice, stream_),
                           "copy the decode step's inputs to the device");
    }
    if (options_.poison_outputs) {
      // All-ones bytes are NaN in every dtype: an element the kernels miss shows instead of a
      // value left from an earlier step.
      RETURN_IF_CUDA_ERROR(cudaMemsetAsync(at(1), 0xff, q_bytes, stream_), "poison o");
      if (lse_bytes) {
        RETURN_IF_CUDA_ERROR(cudaMemsetAsync(at(2), 0xff, lse_bytes, stream_), "poison lse");
      }
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[1], stream_), "cudaEventRecord");
    if (absl::Status s =
            LaunchPagedDecode(*plan, pages_, page_bytes_, *extent, dev, at(6), tickets_, stream_);
        !s.ok()) {
      cudaStreamSynchronize(stream_);
      return s;
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[2], stream_), "cudaEventRecord");
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host.o, at(1), q_bytes, cudaMemcpyDeviceToHost, stream_),
                         "copy o to the host");
    if (lse_bytes) {
      RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(host.lse, at(2), lse_bytes, cudaMemcpyDeviceToHost, stream_),
          "copy lse to the host");
    }
    RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[3], stream_), "cudaEventRecord");
    RETURN_IF_CUDA_ERROR(cudaEventSynchronize(events_[3]), "run the decode step on the device");
    float ms[3];
    for (int i = 0; i < 3; ++i) {
      RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]),
                           "cudaEventElapsedTime");
    }
    return KvStepTimes{ms[0] * 1e3, ms[1] * 1e3, ms[2] * 1e3};
  }

 private:
  // Grows the scratch buffer to at least `bytes`.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= scratch_bytes_) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    void* p = nullptr;
    if (cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
      return AllocationError(bytes, "decode scratch", err);
    }
    scratch_ = static_cast<unsigned char*>(p);
    scratch_bytes_ = bytes;
    return absl::OkStatus();
  }

  // Grows the split tickets to at least `count`, zeroed (the kernels leave them zero).
  absl::Status ReserveTickets(int64_t count) {
    if (count <= ticket_count_) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cudaFree(tickets_);
    tickets_ = nullptr;
    ticket_count_ = 0;
    const size_t bytes = count * sizeof(int32_t);
    void* p = nullptr;
    if (cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
      return AllocationError(bytes, "decode split tickets", err);
    }
    tickets_ = static_cast<int32_t*>(p);
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(tickets_, 0, bytes, stream_), "zero the split tickets");
    ticket_count_ = count;
    return absl::OkStatus();
  }

  const CudaKvPoolOptions options_;
  const int device_, sm_count_;
  const int64_t num_pages_, page_bytes_;
  unsigned char* const pages_;
  std::mutex mu_;
  cudaStream_t stream_;
  cudaEvent_t events_[4];  // before h2d, before the kernels, after them, after d2h
  unsigned char* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  int32_t* tickets_ = nullptr;
  int64_t ticket_count_ = 0;
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
  int sm_count = 0;
  RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
                       "cudaDeviceGetAttribute");
  const size_t bytes = static_cast<size_t>(num_pages) * page_bytes;
  void* pages = nullptr;
  if (cudaError_t err = cudaMalloc(&pages, bytes); err != cudaSuccess) {
    return AllocationError(bytes, "the KV pool", err);
  }
  cudaStream_t stream;
  if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    cudaFree(pages);
    return CudaError(err, "cudaStreamCreate");
  }
  cudaEvent_t events[4];
  for (int i = 0; i < 4; ++i) {
    if (cudaError_t err = cudaEventCreate(&events[i]); err != cudaSuccess) {
      for (int j = 0; j < i; ++j) cudaEventDestroy(events[j]);
      cudaStreamDestroy(stream);
      cudaFree(pages);
      return CudaError(err, "cudaEventCreate");
    }
  }
  return std::unique_ptr<KvPagePool>(
      new CudaKvPagePool(device, sm_count, num_pages, page_bytes, pages, stream, events, options));
}

}  // namespace attention::cuda
