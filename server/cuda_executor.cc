// The CUDA executor: one per GPU. Run copies a request's host tensors to the device, runs the
// CUDA backend and copies o (and lse) back on the device's stream, timing each stage with CUDA
// events (kernels/cuda/host_runner.h). Calls are serialised per device; the pipelined executor
// (pinned buffers, several streams) is later work.
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/host_runner.h"
#include "server/executor.h"

namespace attention::server {
namespace {

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(int ordinal, DeviceDescription device, std::unique_ptr<cuda::HostRunner> runner)
      : ordinal_(ordinal), device_(std::move(device)), runner_(std::move(runner)) {}

  const DeviceDescription& device() const override { return device_; }

  // Memory in use on the whole GPU (every process and context on it), as nvidia-smi shows it.
  absl::StatusOr<MemoryUsage> Memory() const override {
    // The calling thread (a metrics scrape) picks the device first; cudaMemGetInfo is per device.
    if (cudaError_t err = cudaSetDevice(ordinal_); err != cudaSuccess) {
      return cuda::CudaError(err, "cudaSetDevice");
    }
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) {
      return cuda::CudaError(err, "cudaMemGetInfo");
    }
    return MemoryUsage{.used_bytes = static_cast<int64_t>(total_bytes - free_bytes),
                       .total_bytes = static_cast<int64_t>(total_bytes)};
  }

  absl::StatusOr<StageTimes> Run(const AttentionParams& host_params) override {
    absl::StatusOr<cuda::HostRunTimes> times = runner_->Run(host_params);
    if (!times.ok()) return times.status();
    return StageTimes{
        .h2d_us = times->h2d_us, .compute_us = times->compute_us, .d2h_us = times->d2h_us};
  }

 private:
  const int ordinal_;
  const DeviceDescription device_;
  std::unique_ptr<cuda::HostRunner> runner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal) {
  cudaDeviceProp prop;
  if (cudaError_t err = cudaGetDeviceProperties(&prop, ordinal); err != cudaSuccess) {
    return cuda::CudaError(err, absl::StrCat("cudaGetDeviceProperties(", ordinal, ")").c_str());
  }
  DeviceDescription device;
  device.name = absl::StrCat("cuda:", ordinal);
  device.description = prop.name;
  device.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  device.multiprocessors = prop.multiProcessorCount;
  device.compute_capability = absl::StrCat(prop.major, ".", prop.minor);
  absl::StatusOr<std::unique_ptr<cuda::HostRunner>> runner =
      cuda::HostRunner::Create({.device = ordinal});
  if (!runner.ok()) return runner.status();
  return std::make_unique<CudaExecutor>(ordinal, std::move(device), *std::move(runner));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls start clean
    return 0;
  }
  return count;
}

}  // namespace attention::server
