// The CUDA executor: one per GPU, over a cuda::HostRunner (kernels/cuda/runtime/host_runner.h) with
// `streams` CUDA streams, each with its pinned staging and device buffers, reused across
// requests: the scheduler's workers call Run or RunBatch at once and their copies and kernels
// overlap on different streams. A request's H2D, kernel and D2H go on one stream and are timed
// with CUDA events. Batches (RunBatch) run as one launch; a batch too large for the device memory
// budget runs item by item, and an item too large on its own is refused (RESOURCE_EXHAUSTED).
//
// A CUDA error that corrupts the context (an illegal address, a kernel trap: "sticky" errors)
// leaves the device unusable until the process restarts: Health probes the context after a failed
// run and keeps answering that error, so the scheduler sends no more work here.
//
// Host copies of tensor data per request through gRPC: 1, the received slices -> the request's
// pinned host block (server/service/attention_service.h; the block comes from
// MakePinnedHostMemory, host_memory.h). The runner DMAs q, k, v from that block and o into it
// directly (pinned: no staging memcpy), and gRPC sends o from it. (Before the wire path: 4, wire
// -> request bytes, request bytes -> pinned staging, staging -> response bytes, response bytes
// -> wire.) A caller of Run with pageable memory still gets the staging memcpy each way.
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/runtime/host_runner.h"
#include "kernels/cuda/runtime/paged_kv_pool.h"
#include "kernels/status_macros.h"
#include "server/executors/executor.h"

namespace attention::server {
namespace {

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(int ordinal, DeviceDescription device, std::unique_ptr<cuda::HostRunner> runner,
               absl::Duration stream_wait_timeout)
      : ordinal_(ordinal),
        device_(std::move(device)),
        runner_(std::move(runner)),
        stream_wait_timeout_(stream_wait_timeout) {}

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

  absl::Status Health() override {
    std::lock_guard<std::mutex> lock(health_mu_);
    if (!lost_.ok()) return lost_;
    // Every call on a corrupted context answers the sticky error; a busy healthy device answers
    // cudaErrorNotReady for the legacy stream, an idle one cudaSuccess.
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err == cudaSuccess) err = cudaStreamQuery(nullptr);
    if (err != cudaSuccess && err != cudaErrorNotReady) {
      lost_ = cuda::CudaError(err, "device lost, restart the server to use it again");
    }
    return lost_;
  }

  absl::StatusOr<StageTimes> Run(const AttentionParams& host_params) override {
    return ToStageTimes(runner_->Run(host_params));
  }

  bool CanShareLaunch(const AttentionParams& a, const AttentionParams& b) const override {
    return cuda::CanShareLaunch(a, b);
  }

  std::vector<absl::StatusOr<StageTimes>> RunBatch(
      absl::Span<const AttentionParams> items) override {
    if (items.size() > 1 && cuda::HostRunner::DeviceBytes(items) > runner_->memory_budget_bytes()) {
      return Executor::RunBatch(items);  // one at a time: each fits or is refused on its own
    }
    absl::StatusOr<StageTimes> times = ToStageTimes(runner_->RunBatch(items));
    return std::vector<absl::StatusOr<StageTimes>>(items.size(), times);
  }

 protected:
  // The KV pages of sessions: one device allocation, decode steps by the split-KV kernels.
  absl::StatusOr<std::unique_ptr<KvPagePool>> CreateKvPagePool(int64_t num_pages,
                                                               int64_t page_bytes) override {
    return cuda::MakeKvPagePool(ordinal_, num_pages, page_bytes,
                                {.stream_wait_timeout = stream_wait_timeout_});
  }

 private:
  static absl::StatusOr<StageTimes> ToStageTimes(absl::StatusOr<cuda::HostRunTimes> times) {
    if (!times.ok()) return times.status();
    return StageTimes{
        .h2d_us = times->h2d_us, .compute_us = times->compute_us, .d2h_us = times->d2h_us};
  }

  const int ordinal_;
  const DeviceDescription device_;
  std::unique_ptr<cuda::HostRunner> runner_;
  const absl::Duration stream_wait_timeout_;
  std::mutex health_mu_;
  absl::Status lost_;  // guarded by health_mu_; set once, never cleared
};

}  // namespace

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal) {
  return MakeCudaExecutor(ordinal, CudaExecutorOptions{});
}

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal,
                                                           const CudaExecutorOptions& options) {
  if (!(options.memory_fraction > 0 && options.memory_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device memory fraction: expected a value in (0, 1], got ", options.memory_fraction));
  }
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
  device.fast_head_dims = cuda::SpecialisedHeadDims();
  // The forward kernels (Attend) serve every open-model option but a V head dim of its own, which
  // they refuse by name (cuda::RefuseUnservedOptions); the paged decode kernels (a Step) serve all
  // of them, sessions of a V head dim of their own (MLA) included.
  device.attend_options = {"sinks", "softcap", "chunk_size"};
  device.step_options = {"sinks", "softcap", "chunk_size", "v_head_dim", "v_from_k"};
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::HostRunner> runner,
                   cuda::HostRunner::Create(
                       {.device = ordinal,
                        .streams = options.streams,
                        .memory_budget_bytes =
                            options.memory_budget_bytes > 0
                                ? options.memory_budget_bytes
                                : static_cast<int64_t>(options.memory_fraction *
                                                       static_cast<double>(prop.totalGlobalMem))}));
  return std::make_unique<CudaExecutor>(ordinal, std::move(device), std::move(runner),
                                        options.stream_wait_timeout);
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
