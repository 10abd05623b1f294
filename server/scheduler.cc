#include "server/scheduler.h"

#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention::server {

Scheduler::Scheduler(std::vector<std::unique_ptr<Executor>> executors,
                     const SchedulerOptions& options, std::function<void(int)> on_queue_depth)
    : options_(options), on_queue_depth_(std::move(on_queue_depth)) {
  for (auto& executor : executors) slots_.push_back(Slot{std::move(executor)});
  for (int i = 0; i < options_.workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Scheduler::~Scheduler() { Shutdown(); }

void Scheduler::Submit(Job job) {
  absl::Status refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refusal = absl::UnavailableError("server is shutting down");
    } else if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      refusal = absl::ResourceExhaustedError(
          absl::StrCat("queue full: ", queue_.size(), " queued, limit ", options_.max_queue));
    } else {
      queue_.emplace_back(std::move(job), absl::Now());
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
      work_or_stopping_.notify_one();
      return;
    }
  }
  std::move(job.done)(JobResult{.status = refusal});
}

void Scheduler::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_or_stopping_.notify_all();
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

std::vector<const DeviceDescription*> Scheduler::devices() const {
  std::vector<const DeviceDescription*> devices;
  for (const Slot& slot : slots_) devices.push_back(&slot.executor->device());
  return devices;
}

int Scheduler::queue_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size());
}

Scheduler::Slot* Scheduler::AcquireLeastLoaded() {
  Slot* best = &slots_.front();
  for (Slot& slot : slots_) {
    if (slot.in_flight < best->in_flight) best = &slot;
  }
  if (best->in_flight++ == 0) best->busy_since = absl::Now();
  return best;
}

void Scheduler::Release(Slot* slot) {
  if (--slot->in_flight == 0) slot->busy += absl::Now() - slot->busy_since;
}

std::vector<DeviceLoad> Scheduler::device_loads() const {
  std::vector<absl::Duration> busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = absl::Now();
    for (const Slot& slot : slots_) {
      busy.push_back(slot.busy + (slot.in_flight > 0 ? now - slot.busy_since : absl::Duration()));
    }
  }
  // Memory outside the lock: a device may take a while to answer; workers must not wait for it.
  std::vector<DeviceLoad> loads;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Executor& executor = *slots_[i].executor;
    loads.push_back(
        DeviceLoad{.device = &executor.device(), .busy = busy[i], .memory = executor.Memory()});
  }
  return loads;
}

void Scheduler::WorkerLoop() {
  while (true) {
    Job job;
    absl::Time enqueued;
    Slot* slot = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_or_stopping_.wait(lock, [this] { return !queue_.empty() || stopping_; });
      // Queued work is finished even when stopping: callers are still waiting for it.
      if (queue_.empty()) return;
      std::tie(job, enqueued) = std::move(queue_.front());
      queue_.pop_front();
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
    }
    JobResult result;
    const absl::Time now = absl::Now();
    result.queued = now - enqueued;
    // The deadline first: a call past its deadline is also cancelled, and the deadline says why.
    if (now >= job.deadline) {
      result.status = absl::DeadlineExceededError(
          absl::StrCat("deadline passed while queued for ", absl::FormatDuration(result.queued)));
    } else if (job.cancelled && job.cancelled()) {
      result.status = absl::CancelledError("cancelled by the client while queued");
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        slot = AcquireLeastLoaded();
      }
      absl::StatusOr<StageTimes> stages = slot->executor->Run(job.params);
      {
        std::lock_guard<std::mutex> lock(mu_);
        Release(slot);
      }
      result.device = &slot->executor->device();
      if (stages.ok()) {
        result.stages = *stages;
      } else {
        result.status = stages.status();
      }
    }
    std::move(job.done)(std::move(result));
  }
}

}  // namespace attention::server
