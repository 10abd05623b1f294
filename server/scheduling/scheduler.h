// The scheduler: the one bounded queue of every RPC that computes (Attend and its stream, a
// Sessions Step, and the CreateSession/AppendKv writes into a device's KV pool) and a pool of
// worker threads that run them on the executors. Overload is refused at once
// (RESOURCE_EXHAUSTED) rather than queued without bound; work whose caller has gone (cancelled,
// deadline passed) is dropped before it reaches a device.
//
// Three kinds of job: a forward pass (AttentionParams), run on the least-loaded executor; a
// decode step (DecodeWork), run on the executor whose KV pool holds its sessions; and device work
// (DeviceWork: a session's K/V written into a pool), also on its sessions' executor. Jobs that
// name sessions run one at a time per session, in queue order: a job whose session another
// running job holds waits in the queue (later jobs on other sessions pass it), so no worker ever
// waits for a session.
//
// Running work stops too: a watchdog checks the running batches every kStopPoll and sets a
// batch's stop flag (AttentionParams::stop, PagedDecodeParams::stop) once none of its jobs has a
// caller left; the CPU kernels stop at their next tile, so the worker is free within about
// kStopPoll plus one tile. Abort (the end of a drain's grace) answers every queued job and stops
// every running one.
//
// Dynamic batching (max_batch > 1): a worker that takes the oldest runnable job also takes the
// queued jobs that can share its launch, forward passes by Executor::CanShareLaunch, decode steps
// on the same executor with equal DecodeKeys and no common session; it waits up to
// max_queue_delay from the oldest job's arrival for more, until it holds max_batch; the batch
// then runs as one RunBatch or one RunDecode. One worker collects at a time, so jobs arriving
// during the wait join its batch rather than starting batches of one on idle workers.
//
// Spinning (worker_spin > 0): a worker that finds no work polls the queue for up to worker_spin
// before it sleeps, one worker at a time; a job queued meanwhile is taken without waking anyone.
// On a virtual machine a sleeping thread's wake-up costs tens of microseconds (the idle vCPU
// halts and the host must resume it; on the H200 host the queue's hop of a Step measured 24-31 us,
// 8-12 us with a spinning worker), which a decode loop with one Step in flight pays every Step. The
// cost: up to one core busy for worker_spin after each job.
//
// Wake-ups: a sleeping worker is woken only when runnable work is queued (a submission, work left
// behind by a worker that took a batch, sessions freed under queued jobs) or when the scheduler
// stops. Woken for nothing, workers contend for mu_ with the next job, which a one-in-flight
// caller's next request paid in the queue (bench/results/2026-12-02-request-rings.md).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/attention_params.h"
#include "server/executors/executor.h"
#include "server/sessions/step_plan.h"

namespace attention::server {

struct SchedulerOptions {
  int workers = 2;      // threads pulling jobs off the queue
  int max_queue = 256;  // jobs waiting for a worker; more are refused
  int max_batch = 1;    // jobs per RunBatch at most
  // How long the oldest queued job may wait for others to join its batch.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // How long an idle worker polls the queue before it sleeps (zero: it sleeps at once).
  absl::Duration worker_spin = absl::ZeroDuration();
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

// A decode step's part of a launch: sequences of sessions in one executor's KV pool.
struct DecodeWork {
  DecodeKey key;
  // On the worker, before the launch: takes the job's sessions, appends the step's new rows and
  // answers the sequences to attend (host pointers valid until `done`). An error answers this job
  // alone; the others of the launch run.
  absl::AnyInvocable<absl::StatusOr<std::vector<DecodeSequence>>() &&> prepare;
};

// Work on one executor that is not a launch of its own (a session's rows written into its pool).
struct DeviceWork {
  absl::AnyInvocable<absl::StatusOr<StageTimes>() &&> run;
};

struct Job {
  // A forward pass (host pointers that must stay valid until `done`), a decode step or device work.
  std::variant<AttentionParams, DecodeWork, DeviceWork> work;
  // The executor, by its index in the scheduler's order, that must run it (where its sessions'
  // pages are); -1: the least-loaded. Decode and device work must name one.
  int device = -1;
  // Sessions the job holds while it runs (distinct); jobs sharing one never run at once. Views of
  // strings that `keeps` holds (or that outlive the job).
  std::vector<absl::string_view> sessions;
  // What `sessions` views (a Step's state, say), held until the job is destroyed, after the
  // scheduler's last look at its sessions.
  std::shared_ptr<const void> keeps;
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
  // after Shutdown began or when every executor (or the one it names) is out of rotation,
  // INVALID_ARGUMENT when it names no executor of this scheduler.
  void Submit(Job job);
  // Queues every job of `jobs` or none: answers each one with the same refusal when the queue
  // lacks the room for all (a call whose work is several jobs runs whole or not at all).
  void SubmitAll(std::vector<Job> jobs);

  // Refuses new jobs, lets the workers finish every queued and running one, and joins them.
  void Shutdown();
  // Gives up on all work: from now on queued jobs and new ones are answered `why`, and running
  // batches are stopped (their jobs answered `why` unless they had finished). Call before Shutdown
  // when waiting longer is not wanted (a drain's grace ended).
  void Abort(absl::Status why);

  // How often the watchdog looks for running batches whose callers have all gone.
  static constexpr absl::Duration kStopPoll = absl::Milliseconds(10);

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

  // A batch on a device, watched by the watchdog.
  struct Running {
    const std::vector<Queued>* batch = nullptr;
    std::atomic<bool> stop{false};
  };

  void WorkerLoop();
  // With worker_spin and no runnable work: unless another worker spins already, polls
  // submissions_ for up to worker_spin without mu_ (which `lock` holds again on return).
  void Spin(std::unique_lock<std::mutex>& lock);
  void WatchdogLoop();
  // Whether a queued job may start now: none of its sessions is held by a running job. Needs mu_.
  bool RunnableLocked(const Job& job) const;
  bool AnyRunnableLocked() const;
  // Takes the oldest runnable live job and the jobs that may share its launch, per the batching
  // options, and marks their sessions held; jobs found dead go to `dropped` with their answer.
  // Empty when the queue holds no runnable live job. Needs mu_ (held through `lock`, which it may
  // release while waiting).
  std::vector<Queued> CollectBatch(std::unique_lock<std::mutex>& lock,
                                   std::vector<std::pair<Queued, absl::Status>>* dropped);
  // Whether `job` may join `batch` (led by batch[0]) in one launch. Needs mu_.
  bool CanJoin(const std::vector<Queued>& batch, const Job& job) const;
  // Runs `batch` on its executor, answers every job and releases its sessions.
  void RunBatch(std::vector<Queued> batch);
  // The launch of a batch of each kind on `executor`, stopped when `stop` is set: one result per
  // job, in order.
  static std::vector<absl::StatusOr<StageTimes>> RunForward(Executor& executor,
                                                            std::vector<Queued>& batch,
                                                            const std::atomic<bool>* stop);
  static std::vector<absl::StatusOr<StageTimes>> RunDecode(Executor& executor,
                                                           std::vector<Queued>& batch,
                                                           const std::atomic<bool>* stop);
  // After a failed run on `slot`: takes its executor out of rotation if its health check fails.
  void CheckHealth(Slot* slot);
  // The executor `device` names, or when it is -1 the one in service with the fewest jobs
  // running, its count raised; nullptr when that executor (or every one) is out of rotation.
  // Needs mu_.
  Slot* AcquireSlot(int device);
  // Executors not taken out of rotation. Needs mu_.
  int CountInService() const;
  // UNAVAILABLE naming why each executor is out of rotation. Needs mu_.
  absl::Status NoDeviceError() const;
  // UNAVAILABLE naming why `slot` is out of rotation. Needs mu_.
  static absl::Status LostError(const Slot& slot);
  // Why `job` cannot be queued now, with `more` jobs of its call to queue together, or OK.
  // Needs mu_.
  absl::Status RefusalLocked(const Job& job, int more) const;
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
  // Sessions held by running jobs (their Job::sessions, kept by the jobs until RunBatch has
  // erased them); guarded by mu_. Hashed: a Step holds as many as its sequences.
  absl::flat_hash_set<absl::string_view> held_sessions_;
  bool stopping_ = false;    // guarded by mu_
  bool collecting_ = false;  // guarded by mu_: a worker is collecting a batch
  bool spinning_ = false;    // guarded by mu_: a worker is polling for work (worker_spin)
  // Bumped under mu_ by every SubmitAll that queues; the spinning worker polls it without mu_.
  std::atomic<uint64_t> submissions_{0};
  absl::Status aborted_;           // guarded by mu_: set by Abort
  std::vector<Running*> running_;  // guarded by mu_
  std::condition_variable watch_;  // for the watchdog: a batch started, or stopping
  bool watchdog_stop_ = false;     // guarded by mu_
  std::vector<std::thread> workers_;
  std::thread watchdog_;
};

}  // namespace attention::server
