// Runs the CUDA backend on host tensors: copies q, k, v (and cu_seqlens) to one device
// workspace, runs Forward, copies o (and lse) back, and times each stage with CUDA events. The
// server's CUDA executor and the GPU tests share it.
//
// Head dims that are not a multiple of 8 are served by padding: each D-element line of q, k, v
// lands in a zeroed line of D8 = roundup(D, 8) elements (cudaMemcpy2D), the kernel runs with
// head dim D8 (zero columns add nothing to q.k; the scale stays the caller's), and o's first D
// columns are copied back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention_params.h"

namespace attention::cuda {

struct HostRunnerOptions {
  int device = 0;
  // Fill o and lse with NaN on the device before the kernel, so unwritten elements show (tests).
  bool poison_outputs = false;
};

struct HostRunTimes {
  double h2d_us = 0, compute_us = 0, d2h_us = 0;
};

// One device's workspace and stream. Run is thread-safe (calls are serialised).
class HostRunner {
 public:
  // Creates the stream and events on options.device.
  static absl::StatusOr<std::unique_ptr<HostRunner>> Create(const HostRunnerOptions& options);
  ~HostRunner();
  HostRunner(const HostRunner&) = delete;
  HostRunner& operator=(const HostRunner&) = delete;

  // host: every pointer is host memory and the tensors are contiguous (SetContiguousStrides in
  // either layout, or packed varlen). Returns when o (and lse) hold the result.
  absl::StatusOr<HostRunTimes> Run(const AttentionParams& host);

 private:
  HostRunner(const HostRunnerOptions& options, cudaStream_t stream, cudaEvent_t (&events)[4]);
  // Grows the device workspace to at least `bytes`.
  absl::Status Reserve(size_t bytes);

  const HostRunnerOptions options_;
  std::mutex mu_;
  cudaStream_t stream_;
  cudaEvent_t events_[4];  // before h2d, before the kernel, after it, after d2h
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// A Status naming a CUDA error: InternalError("cuda backend: <what>: <name>: <description>").
absl::Status CudaError(cudaError_t err, const char* what);

}  // namespace attention::cuda
