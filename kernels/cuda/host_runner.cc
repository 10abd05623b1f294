#include "kernels/cuda/host_runner.h"

#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_attention.h"

namespace attention::cuda {
namespace {

constexpr size_t kAlign = 256;

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

#define RETURN_IF_CUDA_ERROR(expr, what)              \
  do {                                                \
    if (cudaError_t err_ = (expr); err_ != cudaSuccess) \
      return CudaError(err_, what);                   \
  } while (0)

// Element counts of the contiguous host tensors.
struct Extents {
  int64_t rows_q, rows_k;  // B * N, or total rows when varlen
};

Extents GetExtents(const AttentionParams& p) {
  if (p.is_varlen()) return {p.total_q, p.total_k};
  return {p.batch * p.seqlen_q, p.batch * p.seqlen_k};
}

}  // namespace

absl::Status CudaError(cudaError_t err, const char* what) {
  return absl::InternalError(absl::StrCat("cuda backend: ", what, ": ", cudaGetErrorName(err),
                                          ": ", cudaGetErrorString(err)));
}

absl::StatusOr<std::unique_ptr<HostRunner>> HostRunner::Create(const HostRunnerOptions& options) {
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options.device), "cudaSetDevice");
  cudaStream_t stream;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "cudaStreamCreate");
  cudaEvent_t events[4];
  for (cudaEvent_t& e : events) {
    if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
      cudaStreamDestroy(stream);
      return CudaError(err, "cudaEventCreate");
    }
  }
  return std::unique_ptr<HostRunner>(new HostRunner(options, stream, events));
}

HostRunner::HostRunner(const HostRunnerOptions& options, cudaStream_t stream,
                       cudaEvent_t (&events)[4])
    : options_(options), stream_(stream) {
  for (int i = 0; i < 4; ++i) events_[i] = events[i];
}

HostRunner::~HostRunner() {
  cudaSetDevice(options_.device);
  cudaFree(workspace_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  cudaStreamDestroy(stream_);
}

absl::Status HostRunner::Reserve(size_t bytes) {
  if (bytes <= workspace_bytes_) return absl::OkStatus();
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  cudaFree(workspace_);
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  if (cudaError_t err = cudaMalloc(&workspace_, bytes); err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free allocation error
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda backend: cannot allocate ", bytes, " bytes of device memory: ",
                     cudaGetErrorName(err)));
  }
  workspace_bytes_ = bytes;
  return absl::OkStatus();
}

absl::StatusOr<HostRunTimes> HostRunner::Run(const AttentionParams& host) {
  if (absl::Status s = CheckParams(host); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");

  const size_t elem = DTypeSize(host.dtype);
  const int64_t d = host.head_dim, d8 = (d + 7) / 8 * 8;
  const Extents ext = GetExtents(host);
  // Lines of D elements in each tensor (contiguous in both layouts).
  const int64_t lines_q = ext.rows_q * host.heads_q, lines_k = ext.rows_k * host.heads_kv;
  const size_t q_bytes = lines_q * d8 * elem, k_bytes = lines_k * d8 * elem;
  const size_t lse_bytes = host.lse ? lines_q * sizeof(float) : 0;
  const size_t cu_bytes = host.is_varlen() ? (host.batch + 1) * sizeof(int32_t) : 0;

  // Workspace: q | k | v | o | lse | cu_seqlens_q | cu_seqlens_k, each 256-byte aligned.
  size_t offsets[8] = {0};
  const size_t sizes[7] = {q_bytes, k_bytes, k_bytes, q_bytes, lse_bytes, cu_bytes, cu_bytes};
  for (int i = 0; i < 7; ++i) offsets[i + 1] = offsets[i] + RoundUp(sizes[i], kAlign);
  if (absl::Status s = Reserve(offsets[7]); !s.ok()) return s;
  auto at = [&](int i) { return static_cast<char*>(workspace_) + offsets[i]; };

  AttentionParams dev = host;
  dev.q = at(0);
  dev.k = at(1);
  dev.v = at(2);
  dev.o = at(3);
  dev.lse = host.lse ? reinterpret_cast<float*>(at(4)) : nullptr;
  if (host.is_varlen()) {
    dev.cu_seqlens_q = reinterpret_cast<const int32_t*>(at(5));
    dev.cu_seqlens_k = reinterpret_cast<const int32_t*>(at(6));
  }
  if (d8 != d) {
    // Contiguous strides are multiples of D: the same tensor with D8-element lines.
    for (int64_t* s : {&dev.q_batch_stride, &dev.q_head_stride, &dev.q_row_stride,
                       &dev.k_batch_stride, &dev.k_head_stride, &dev.k_row_stride,
                       &dev.v_batch_stride, &dev.v_head_stride, &dev.v_row_stride,
                       &dev.o_batch_stride, &dev.o_head_stride, &dev.o_row_stride}) {
      *s = *s / d * d8;
    }
    dev.head_dim = d8;
  }

  RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[0], stream_), "cudaEventRecord");
  auto h2d = [&](void* dst, const void* src, int64_t lines) {
    if (d8 == d) return cudaMemcpyAsync(dst, src, lines * d * elem, cudaMemcpyHostToDevice, stream_);
    cudaError_t err = cudaMemsetAsync(dst, 0, lines * d8 * elem, stream_);
    if (err != cudaSuccess) return err;
    return cudaMemcpy2DAsync(dst, d8 * elem, src, d * elem, d * elem, lines,
                             cudaMemcpyHostToDevice, stream_);
  };
  RETURN_IF_CUDA_ERROR(h2d(at(0), host.q, lines_q), "copy q to the device");
  RETURN_IF_CUDA_ERROR(h2d(at(1), host.k, lines_k), "copy k to the device");
  RETURN_IF_CUDA_ERROR(h2d(at(2), host.v, lines_k), "copy v to the device");
  if (host.is_varlen()) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(at(5), host.cu_seqlens_q, cu_bytes,
                                         cudaMemcpyHostToDevice, stream_),
                         "copy cu_seqlens_q to the device");
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(at(6), host.cu_seqlens_k, cu_bytes,
                                         cudaMemcpyHostToDevice, stream_),
                         "copy cu_seqlens_k to the device");
  }
  if (options_.poison_outputs) {
    // All-ones bytes are NaN in float32, float16 and bfloat16.
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(at(3), 0xff, q_bytes, stream_), "poison o");
    if (lse_bytes) RETURN_IF_CUDA_ERROR(cudaMemsetAsync(at(4), 0xff, lse_bytes, stream_), "poison lse");
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[1], stream_), "cudaEventRecord");
  if (absl::Status s = Forward(dev, stream_); !s.ok()) {
    cudaStreamSynchronize(stream_);
    return s;
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[2], stream_), "cudaEventRecord");
  if (d8 == d) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host.o, at(3), q_bytes, cudaMemcpyDeviceToHost, stream_),
                         "copy o to the host");
  } else {
    RETURN_IF_CUDA_ERROR(cudaMemcpy2DAsync(host.o, d * elem, at(3), d8 * elem, d * elem, lines_q,
                                           cudaMemcpyDeviceToHost, stream_),
                         "copy o to the host");
  }
  if (lse_bytes) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host.lse, at(4), lse_bytes, cudaMemcpyDeviceToHost, stream_),
        "copy lse to the host");
  }
  RETURN_IF_CUDA_ERROR(cudaEventRecord(events_[3], stream_), "cudaEventRecord");
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(events_[3]), "run on the device");

  float ms[3];
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]),
                         "cudaEventElapsedTime");
  }
  return HostRunTimes{ms[0] * 1e3, ms[1] * 1e3, ms[2] * 1e3};
}

}  // namespace attention::cuda
