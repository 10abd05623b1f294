// An executor runs decoded requests on one device. The scheduler hands it work; it owns whatever
// the device needs (threads for the CPU; streams and buffers for a GPU).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/attention_params.h"
#include "kernels/paged_kv.h"

namespace attention::server {

// Microseconds spent in each stage of one run (h2d and d2h stay 0 on the CPU).
struct StageTimes {
  double h2d_us = 0;
  double compute_us = 0;
  double d2h_us = 0;
  // Set by the scheduler around the executor (ServerTiming's prepare_us and run_us).
  double prepare_us = 0;
  double run_us = 0;
};

// What a device is, for GetServerInfo and metrics labels.
struct DeviceDescription {
  std::string name;         // "cpu", "cuda:0"
  std::string description;  // CPU model or GPU name
  int64_t memory_bytes = 0;
  int multiprocessors = 0;         // SMs, or CPU cores
  std::string compute_capability;  // "9.0"; empty for the CPU
  // Head dims its kernels specialise (faster than the rest; every head dim up to the limit runs),
  // from the backend's own dispatch lists. Empty when one code path serves every head dim.
  std::vector<int> fast_head_dims;
  // The open-model options (AttendRequest's field names) its kernels serve on Attend and on Step;
  // the others they refuse UNIMPLEMENTED by name. Empty: none.
  std::vector<std::string> attend_options;
  std::vector<std::string> step_options;
};

// A device's memory at one moment, for metrics.
struct MemoryUsage {
  int64_t used_bytes = 0;
  int64_t total_bytes = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;

  virtual const DeviceDescription& device() const = 0;

  // The device's memory now; called on every metrics scrape, so it must be cheap and
  // thread-safe. Executors that cannot tell answer UNIMPLEMENTED (the metric is then absent).
  virtual absl::StatusOr<MemoryUsage> Memory() const {
    return absl::UnimplementedError("this executor does not report its memory");
  }

  // Runs one forward pass whose pointers (q, k, v, o, lse, cu_seqlens) are all host memory, and
  // returns when o (and lse) hold the result. Thread-safe: the server's workers call it at once.
  virtual absl::StatusOr<StageTimes> Run(const AttentionParams& host_params) = 0;

  // Dynamic batching. Whether requests `a` and `b` may run in one RunBatch call (one launch).
  // The default, never, keeps every batch at one request.
  virtual bool CanShareLaunch(const AttentionParams& a, const AttentionParams& b) const {
    return false;
  }
  // Runs `items`, each CanShareLaunch with items[0], and returns one result per item, in order.
  // Items that share a launch share its stage times. The default runs them one by one.
  virtual std::vector<absl::StatusOr<StageTimes>> RunBatch(
      absl::Span<const AttentionParams> items) {
    std::vector<absl::StatusOr<StageTimes>> results;
    for (const AttentionParams& item : items) results.push_back(Run(item));
    return results;
  }

  // OK while the device can run work. The scheduler asks after a failed run: an executor whose
  // device can run nothing more (a CUDA error that leaves the context unusable until the process
  // restarts) answers that error from then on, and the scheduler takes it out of rotation.
  // Thread-safe.
  virtual absl::Status Health() { return absl::OkStatus(); }

  // Creates this executor's pool of `num_pages` KV pages of `page_bytes` for KV-resident sessions
  // and keeps it: the sessions' store writes rows into it, and RunDecode attends to them. Called
  // once at startup, before the executor runs work; RESOURCE_EXHAUSTED when the device cannot hold
  // it, UNIMPLEMENTED when the backend keeps no pages. The pool lives as long as the executor.
  absl::StatusOr<KvPagePool*> InitKvPool(int64_t num_pages, int64_t page_bytes);
  // The pool InitKvPool made, or nullptr.
  KvPagePool* kv_pool() const { return kv_pool_.get(); }

  // Runs one decode/extend step over sequences already in this executor's KV pool (host pointers,
  // see kernels/paged_kv.h) and returns when o (and lse) are written. Thread-safe.
  absl::StatusOr<StageTimes> RunDecode(const PagedDecodeParams& host_params);

 protected:
  // The backend's page pool; InitKvPool keeps what it returns.
  virtual absl::StatusOr<std::unique_ptr<KvPagePool>> CreateKvPagePool(int64_t num_pages,
                                                                       int64_t page_bytes) {
    return absl::UnimplementedError("this executor keeps no KV pages");
  }

 private:
  std::unique_ptr<KvPagePool> kv_pool_;
};

// The CPU backend's executor, `threads` compute threads (0 = all cores), its device called `name`.
std::unique_ptr<Executor> MakeCpuExecutor(int threads, std::string name = "cpu");

// The CUDA executor for device `ordinal`; an error when the device cannot be used. Defined only
// in builds with CUDA (ATTENTION_HAVE_CUDA).
absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal);

struct CudaExecutorOptions {
  // Requests (or batches) in flight on the device at once, each on its own CUDA stream with its
  // own pinned staging and device buffers.
  int streams = 4;
  // Share of the device's memory the executor's buffers may hold; a request needing more is
  // refused with RESOURCE_EXHAUSTED before anything is allocated.
  double memory_fraction = 0.65;  // the server default; the KV cache takes its share beside it
  // When > 0, the budget in bytes instead of memory_fraction (tests).
  int64_t memory_budget_bytes = 0;
  // How long a session step's stream waits for a caller's ready_counter or ready_event before the
  // server goes on without it (kernels/cuda/runtime/counter_waits.h).
  absl::Duration stream_wait_timeout = absl::Seconds(60);
};
absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(int ordinal,
                                                           const CudaExecutorOptions& options);
// Number of visible CUDA devices; 0 in builds without CUDA or on machines without a GPU.
int CudaDeviceCount();

}  // namespace attention::server
