// pipeline_bench: the server's GPU pipeline without gRPC. It measures, in one run:
//   - the anchors: the pinned host<->device copy rate (cudaMemcpy of 256 MiB, pinned to device
//     and back) and the kernel's own rate on the shape (Forward on device buffers, CUDA events);
//   - the pipeline: CUDA executors on --gpus GPUs behind the server's Scheduler (dynamic batching
//     per --max_batch and --max_queue_delay_us), driven by --clients closed-loop clients that
//     submit jobs directly, as the gRPC service does after decoding. Every request copies its q,
//     k, v to the device and o back (inputs shared by the clients are read-only, each client
//     has its own o); --pinned_inputs puts the host tensors in pinned memory (what decoding
//     straight into pinned memory would give: no staging memcpy), otherwise pageable (what the
//     protobuf parse gives).
// It prints one JSON object: rates, GPU busy (sum of kernel time over wall time, per GPU), the
// DMA rate seen by the requests, and latency percentiles.
//
//   pipeline_bench --shape=4,16,4096,128 --dtype=bfloat16 --clients=16 --gpus=1 --duration_s=5
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/cuda/forward/cuda_attention.h"
#include "server/executors/executor.h"
#include "server/scheduling/scheduler.h"

ABSL_FLAG(std::string, shape, "4,16,4096,128", "B,H,N,D (BHSD)");
ABSL_FLAG(std::string, dtype, "bfloat16", "float32 | float16 | bfloat16");
ABSL_FLAG(bool, causal, false, "causal mask");
ABSL_FLAG(int, gpus, 1, "GPUs 0..gpus-1, one executor each");
ABSL_FLAG(int, streams, 4, "CUDA streams per GPU");
ABSL_FLAG(int, clients, 16, "closed-loop clients (requests in flight)");
ABSL_FLAG(int, max_batch, 1, "requests per launch at most");
ABSL_FLAG(int, max_queue_delay_us, 0, "batching delay");
ABSL_FLAG(bool, pinned_inputs, false, "host tensors in pinned memory (no staging memcpy)");
ABSL_FLAG(double, warmup_s, 1, "seconds before measuring");
ABSL_FLAG(double, duration_s, 5, "measured seconds");

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    if (cudaError_t err_ = (expr); err_ != cudaSuccess) {                \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Percentile(std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
}

// Pinned host <-> device copy rate of `bytes`, GB/s, median of 5: {h2d, d2h}.
std::pair<double, double> PinnedCopyRate(size_t bytes) {
  void *host = nullptr, *dev = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocPortable));
  CHECK_CUDA(cudaMalloc(&dev, bytes));
  std::memset(host, 1, bytes);
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> h2d, d2h;
  for (int i = 0; i < 6; ++i) {
    float ms = 0;
    CHECK_CUDA(cudaEventRecord(a));
    CHECK_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) h2d.push_back(bytes / (ms * 1e6));
    CHECK_CUDA(cudaEventRecord(a));
    CHECK_CUDA(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) d2h.push_back(bytes / (ms * 1e6));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(dev);
  cudaFreeHost(host);
  return {Median(h2d), Median(d2h)};
}

// The kernel alone on device buffers: median milliseconds of 20 launches after 3.
double KernelMs(AttentionParams p, size_t q_bytes, size_t kv_bytes) {
  void *q, *k, *v, *o;
  CHECK_CUDA(cudaMalloc(&q, q_bytes));
  CHECK_CUDA(cudaMalloc(&k, kv_bytes));
  CHECK_CUDA(cudaMalloc(&v, kv_bytes));
  CHECK_CUDA(cudaMalloc(&o, q_bytes));
  CHECK_CUDA(cudaMemset(q, 0x3c, q_bytes));
  CHECK_CUDA(cudaMemset(k, 0x3c, kv_bytes));
  CHECK_CUDA(cudaMemset(v, 0x3c, kv_bytes));
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  absl::StatusOr<cuda::ForwardScratch> scratch = cuda::AllocateForwardScratch();
  if (!scratch.ok()) {
    std::fprintf(stderr, "AllocateForwardScratch: %s\n", scratch.status().ToString().c_str());
    std::exit(1);
  }
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < 23; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    if (absl::Status s = cuda::Forward(p, nullptr, *scratch); !s.ok()) {
      std::fprintf(stderr, "Forward: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    if (i >= 3) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  for (void* ptr : {q, k, v, o}) cudaFree(ptr);
  cuda::FreeForwardScratch(*scratch);
  return Median(ms);
}

// Host memory, pinned or pageable.
struct HostBuffer {
  HostBuffer(size_t bytes, bool pinned) : pinned(pinned) {
    if (pinned) {
      CHECK_CUDA(cudaHostAlloc(&data, bytes, cudaHostAllocPortable));
    } else {
      data = std::malloc(bytes);
    }
    std::memset(data, 0x3c, bytes);  // 0x3c3c: a small positive value in every dtype
  }
  ~HostBuffer() {
    if (pinned) {
      cudaFreeHost(data);
    } else {
      std::free(data);
    }
  }
  void* data = nullptr;
  bool pinned;
};

// What the clients record, measured requests only.
struct Totals {
  std::mutex mu;
  std::vector<double> latency_ms;
  std::map<std::string, double> compute_us;  // per device: sum of kernel time, counted per launch
  double h2d_us = 0, d2h_us = 0;             // sums over requests (a batch's time per item)
  int64_t requests = 0, errors = 0;
  std::string first_error;
};

int Main() {
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_shape), ',')) {
    int64_t x = 0;
    if (!absl::SimpleAtoi(part, &x)) return 2;
    shape.push_back(x);
  }
  if (shape.size() != 4) return 2;
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  AttentionParams p;
  p.dtype = dtype_name == "float32"   ? DType::kFloat32
            : dtype_name == "float16" ? DType::kFloat16
                                      : DType::kBFloat16;
  p.batch = shape[0];
  p.heads_q = p.heads_kv = shape[1];
  p.seqlen_q = p.seqlen_k = shape[2];
  p.head_dim = shape[3];
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  if (absl::GetFlag(FLAGS_causal)) p.window_right = 0;
  p.SetContiguousStrides(Layout::kBHSD);
  const size_t elem = DTypeSize(p.dtype);
  const size_t q_bytes = p.batch * p.heads_q * p.seqlen_q * p.head_dim * elem;
  const size_t kv_bytes = p.batch * p.heads_kv * p.seqlen_k * p.head_dim * elem;

  CHECK_CUDA(cudaSetDevice(0));
  const auto [pinned_h2d, pinned_d2h] = PinnedCopyRate(size_t{256} << 20);
  const double kernel_ms = KernelMs(p, q_bytes, kv_bytes);

  const int gpus = absl::GetFlag(FLAGS_gpus);
  const int streams = absl::GetFlag(FLAGS_streams);
  std::vector<std::unique_ptr<server::Executor>> executors;
  for (int i = 0; i < gpus; ++i) {
    absl::StatusOr<std::unique_ptr<server::Executor>> e =
        server::MakeCudaExecutor(i, {.streams = streams});
    if (!e.ok()) {
      std::fprintf(stderr, "executor %d: %s\n", i, e.status().ToString().c_str());
      return 1;
    }
    executors.push_back(*std::move(e));
  }
  server::Scheduler scheduler(
      std::move(executors),
      {.workers = streams * gpus,
       .max_queue = 4096,
       .max_batch = absl::GetFlag(FLAGS_max_batch),
       .max_queue_delay = absl::Microseconds(absl::GetFlag(FLAGS_max_queue_delay_us))});

  const bool pinned = absl::GetFlag(FLAGS_pinned_inputs);
  HostBuffer q(q_bytes, pinned), k(kv_bytes, pinned), v(kv_bytes, pinned);
  const int clients = absl::GetFlag(FLAGS_clients);
  const Clock::time_point start = Clock::now();
  const Clock::time_point measure_from =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(absl::GetFlag(FLAGS_warmup_s)));
  const Clock::time_point stop_at =
      measure_from + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(absl::GetFlag(FLAGS_duration_s)));
  Totals totals;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      HostBuffer o(q_bytes, pinned);
      AttentionParams mine = p;
      mine.q = q.data;
      mine.k = k.data;
      mine.v = v.data;
      mine.o = o.data;
      while (true) {
        const Clock::time_point sent = Clock::now();
        if (sent >= stop_at) return;
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
        server::JobResult result;
        server::Job job;
        job.work = mine;
        job.done = [&](server::JobResult r) {
          std::lock_guard<std::mutex> lock(mu);
          result = std::move(r);
          done = true;
          cv.notify_one();
        };
        scheduler.Submit(std::move(job));
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return done; });
        }
        const Clock::time_point end = Clock::now();
        if (sent < measure_from || end > stop_at) continue;
        std::lock_guard<std::mutex> lock(totals.mu);
        if (!result.status.ok()) {
          ++totals.errors;
          if (totals.first_error.empty()) totals.first_error = result.status.ToString();
          continue;
        }
        ++totals.requests;
        totals.latency_ms.push_back(std::chrono::duration<double, std::milli>(end - sent).count());
        if (result.leads_batch) totals.compute_us[result.device->name] += result.stages.compute_us;
        totals.h2d_us += result.stages.h2d_us;
        totals.d2h_us += result.stages.d2h_us;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  scheduler.Shutdown();

  const double wall_s = absl::GetFlag(FLAGS_duration_s);
  const double rps = totals.requests / wall_s;
  const double kernel_rps = 1e3 / kernel_ms;  // one request per launch
  std::string busy;
  double busy_sum = 0;
  for (const auto& [device, us] : totals.compute_us) {
    busy += absl::StrFormat("%s\"%s\":%.4f", busy.empty() ? "" : ",", device, us * 1e-6 / wall_s);
    busy_sum += us * 1e-6 / wall_s;
  }
  std::sort(totals.latency_ms.begin(), totals.latency_ms.end());
  const double n = std::max<int64_t>(totals.requests, 1);
  const double in_bytes = static_cast<double>(q_bytes + 2 * kv_bytes);
  // Copy rates: per request (its stage time; streams share the link, so this is below the link
  // rate when several copy at once) and aggregate (bytes of all requests over wall time).
  absl::PrintF(
      "{\"shape\":\"%s\",\"dtype\":\"%s\",\"gpus\":%d,\"streams\":%d,\"clients\":%d,"
      "\"max_batch\":%d,\"max_queue_delay_us\":%d,\"pinned_inputs\":%s,"
      "\"pinned_h2d_gb_s\":%.2f,\"pinned_d2h_gb_s\":%.2f,\"kernel_ms\":%.4f,"
      "\"kernel_requests_per_s\":%.1f,\"requests\":%d,\"errors\":%d,\"first_error\":\"%s\","
      "\"requests_per_s\":%.1f,\"per_gpu_vs_kernel\":%.3f,\"gpu_busy\":{%s},"
      "\"gpu_busy_mean\":%.4f,\"h2d_gb_s\":%.2f,\"d2h_gb_s\":%.2f,"
      "\"h2d_stage_ms\":%.3f,\"d2h_stage_ms\":%.3f,\"p50_ms\":%.3f,\"p99_ms\":%.3f}\n",
      absl::GetFlag(FLAGS_shape), dtype_name, gpus, streams, clients,
      absl::GetFlag(FLAGS_max_batch), absl::GetFlag(FLAGS_max_queue_delay_us),
      pinned ? "true" : "false", pinned_h2d, pinned_d2h, kernel_ms, kernel_rps, totals.requests,
      totals.errors, totals.first_error, rps, rps / gpus / kernel_rps, busy, busy_sum / gpus,
      rps * in_bytes / 1e9, rps * q_bytes / 1e9, totals.h2d_us / n / 1e3, totals.d2h_us / n / 1e3,
      Percentile(totals.latency_ms, 0.5), Percentile(totals.latency_ms, 0.99));
  return 0;
}

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attention::bench::Main();
}
