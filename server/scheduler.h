// The scheduler: a bounded queue of decoded requests and a pool of worker threads that run them on
// the least-loaded executor. Overload is refused at once (RESOURCE_EXHAUSTED) rather than queued
// without bound; work whose caller has gone (cancelled, deadline passed) is dropped before it
// reaches a device.
#pragma once

#include <cstdint>
#include <deque>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/attention_params.h"
#include "server/executor.h"

namespace attention::server {

struct SchedulerOptions {
  int workers = 2;      // threads pulling jobs off the queue
  int max_queue = 256;  // jobs waiting for a worker; more are refused
};

// What happened to a job. `device` is the executor's device when the job ran, else nullptr.
struct JobResult {
  absl::Status status;
  StageTimes stages;
  absl::Duration queued;
  const DeviceDescription* device = nullptr;
};

struct Job {
  // Host pointers; they must stay valid until `done` is called.
  AttentionParams params;
  // The caller's deadline; a job still queued when it passes is answered DEADLINE_EXCEEDED.
  absl::Time deadline = absl::InfiniteFuture();
  // True once the caller has gone; a queued job is then answered CANCELLED. May be empty.
  absl::AnyInvocable<bool() const> cancelled;
  // Called exactly once: from Submit itself when the job is refused, else from a worker.
  absl::AnyInvocable<void(JobResult) &&> done;
};

// One device's load, for metrics.
struct DeviceLoad {
  const DeviceDescription* device = nullptr;
  // Wall time since the scheduler started during which at least one job ran on the device
  // (for a GPU the executor serialises its runs, so this is copies and kernels back to back).
  absl::Duration busy;
  absl::StatusOr<MemoryUsage> memory;
};

class Scheduler {
 public:
  // Starts the workers. `executors` must not be empty. `on_queue_depth` (may be empty) is told
  // the queue length each time it changes.
  Scheduler(std::vector<std::unique_ptr<Executor>> executors, const SchedulerOptions& options,
            std::function<void(int)> on_queue_depth = {});
  // Stops: see Shutdown.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `job`, or answers it at once: RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE
  // after Shutdown began.
  void Submit(Job job);

  // Refuses new jobs, lets the workers finish every queued and running one, and joins them.
  void Shutdown();

  // One entry per executor, in the order given.
  std::vector<const DeviceDescription*> devices() const;
  int queue_depth() const;
  int max_queue() const { return options_.max_queue; }
  // One entry per executor, in the order given; asks each executor for its memory.
  std::vector<DeviceLoad> device_loads() const;

 private:
  struct Slot {
    std::unique_ptr<Executor> executor;
    // Guarded by mu_: jobs running, and the busy time (at least one running) so far, not
    // counting the current busy period, which began at busy_since.
    int in_flight = 0;
    absl::Duration busy;
    absl::Time busy_since;
  };

  void WorkerLoop();
  // The executor with the fewest jobs running; its count is raised. Needs mu_.
  Slot* AcquireLeastLoaded();
  // Lowers the slot's count after a run. Needs mu_.
  static void Release(Slot* slot);

  const SchedulerOptions options_;
  const std::function<void(int)> on_queue_depth_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer sees pthread locks, while the system's
  // abseil is built without its annotations.
  mutable std::mutex mu_;
  std::condition_variable work_or_stopping_;
  std::vector<Slot> slots_;
  std::deque<std::pair<Job, absl::Time>> queue_;  // guarded by mu_: job, enqueue time
  bool stopping_ = false;  // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace attention::server
