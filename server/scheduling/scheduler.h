// The scheduler: a bounded queue of decoded requests and a pool of worker threads that run them on
// the least-loaded executor. Overload is refused at once (RESOURCE_EXHAUSTED) rather than queued
// without bound; work whose caller has gone (cancelled, deadline passed) is dropped before it
// reaches a device.
//
// Dynamic batching (max_batch > 1): a worker that takes the oldest request also takes the queued
// requests that can share its launch (Executor::CanShareLaunch), waiting up to max_queue_delay
// from the oldest request's arrival for more, until it holds max_batch; the batch then goes to the
// least-loaded executor as one RunBatch. One worker collects at a time, so requests arriving
// during the wait join its batch rather than starting batches of one on idle workers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/attention_params.h"
#include "server/executors/executor.h"

namespace attention::server {

struct SchedulerOptions {
  int workers = 2;      // threads pulling jobs off the queue
  int max_queue = 256;  // jobs waiting for a worker; more are refused
  int max_batch = 1;    // jobs per RunBatch at most
  // How long the oldest queued job may wait for others to join its batch.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Told when an executor is taken out of rotation (its Health failed after a run), with the
  // number of executors still in service. May be empty.
  std::function<void(const DeviceDescription&, const absl::Status&, int in_service)> on_device_lost;
};

// What happened to a job. `device` is the executor's device when the job ran, else nullptr.
struct JobResult {
  absl::Status status;
  StageTimes stages;
  absl::Duration queued;
  const DeviceDescription* device = nullptr;
  int batch_size = 0;        // jobs in the launch this one ran in; 0 when it did not run
  bool leads_batch = false;  // the first job of its launch (so each launch is counted once)
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
  // (for a GPU this counts copies and kernels of all its streams, overlapped or not).
  absl::Duration busy;
  // Batches running on the device now (up to one per worker; the GPU overlaps them on streams).
  int running = 0;
  absl::StatusOr<MemoryUsage> memory;
  // OK while the device takes work; the error that took it out of rotation otherwise.
  absl::Status lost;
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
  // after Shutdown began or when every executor is out of rotation.
  void Submit(Job job);

  // Refuses new jobs, lets the workers finish every queued and running one, and joins them.
  void Shutdown();

  // One entry per executor, in the order given.
  std::vector<const DeviceDescription*> devices() const;
  int queue_depth() const;
  // Executors not taken out of rotation.
  int devices_in_service() const;
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
    // Guarded by mu_: not OK once the executor failed its health check; it gets no more jobs.
    absl::Status lost;
  };

  using Queued = std::pair<Job, absl::Time>;  // job, enqueue time

  void WorkerLoop();
  // Takes the oldest live job and the jobs that may share its launch, per the batching options;
  // jobs found dead go to `dropped` with their answer. Empty when the queue holds no live job.
  // Needs mu_ (held through `lock`, which it may release while waiting).
  std::vector<Queued> CollectBatch(std::unique_lock<std::mutex>& lock,
                                   std::vector<std::pair<Queued, absl::Status>>* dropped);
  // Runs `batch` on the least-loaded executor and answers every job.
  void RunBatch(std::vector<Queued> batch);
  // After a failed run on `slot`: takes its executor out of rotation if its health check fails.
  void CheckHealth(Slot* slot);
  // The executor in service with the fewest jobs running, its count raised; nullptr when every
  // executor is out of rotation. Needs mu_.
  Slot* AcquireLeastLoaded();
  // Executors not taken out of rotation. Needs mu_.
  int CountInService() const;
  // UNAVAILABLE naming why each executor is out of rotation. Needs mu_.
  absl::Status NoDeviceError() const;
  // Lowers the slot's count after a run. Needs mu_.
  static void Release(Slot* slot);

  const SchedulerOptions options_;
  const std::function<void(int)> on_queue_depth_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer sees pthread locks, while the system's
  // abseil is built without its annotations.
  mutable std::mutex mu_;
  std::condition_variable work_or_stopping_;
  std::condition_variable arrivals_;  // a job was queued (the collecting worker waits on it)
  std::vector<Slot> slots_;
  std::deque<Queued> queue_;  // guarded by mu_
  bool stopping_ = false;     // guarded by mu_
  bool collecting_ = false;   // guarded by mu_: a worker is collecting a batch
  std::vector<std::thread> workers_;
};

}  // namespace attention::server
