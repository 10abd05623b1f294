#include "server/scheduling/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

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
    } else if (CountInService() == 0) {
      refusal = NoDeviceError();
    } else if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      refusal = absl::ResourceExhaustedError(
          absl::StrCat("queue full: ", queue_.size(), " queued, limit ", options_.max_queue));
    } else {
      queue_.emplace_back(std::move(job), absl::Now());
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
      work_or_stopping_.notify_one();
      arrivals_.notify_one();
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
  arrivals_.notify_all();
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

int Scheduler::devices_in_service() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CountInService();
}

int Scheduler::CountInService() const {
  int count = 0;
  for (const Slot& slot : slots_) count += slot.lost.ok() ? 1 : 0;
  return count;
}

absl::Status Scheduler::NoDeviceError() const {
  std::string why;
  for (const Slot& slot : slots_) {
    absl::StrAppend(&why, why.empty() ? "" : "; ", slot.executor->device().name, ": ",
                    slot.lost.message());
  }
  return absl::UnavailableError(absl::StrCat("every device is out of service (", why, ")"));
}

Scheduler::Slot* Scheduler::AcquireLeastLoaded() {
  Slot* best = nullptr;
  for (Slot& slot : slots_) {
    if (slot.lost.ok() && (best == nullptr || slot.in_flight < best->in_flight)) best = &slot;
  }
  if (best != nullptr && best->in_flight++ == 0) best->busy_since = absl::Now();
  return best;
}

void Scheduler::Release(Slot* slot) {
  if (--slot->in_flight == 0) slot->busy += absl::Now() - slot->busy_since;
}

std::vector<DeviceLoad> Scheduler::device_loads() const {
  std::vector<absl::Duration> busy;
  std::vector<int> running;
  std::vector<absl::Status> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = absl::Now();
    for (const Slot& slot : slots_) {
      busy.push_back(slot.busy + (slot.in_flight > 0 ? now - slot.busy_since : absl::Duration()));
      running.push_back(slot.in_flight);
      lost.push_back(slot.lost);
    }
  }
  // Memory outside the lock: a device may take a while to answer; workers must not wait for it.
  std::vector<DeviceLoad> loads;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Executor& executor = *slots_[i].executor;
    loads.push_back(DeviceLoad{.device = &executor.device(),
                               .busy = busy[i],
                               .running = running[i],
                               .memory = executor.Memory(),
                               .lost = std::move(lost[i])});
  }
  return loads;
}

namespace {

// Why a queued job must not run (its deadline passed, its caller cancelled), or OK.
absl::Status DropReason(const Job& job, absl::Time now, absl::Duration queued) {
  // The deadline first: a call past its deadline is also cancelled, and the deadline says why.
  if (now >= job.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while queued for ", absl::FormatDuration(queued)));
  }
  if (job.cancelled && job.cancelled()) {
    return absl::CancelledError("cancelled by the client while queued");
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<Scheduler::Queued> Scheduler::CollectBatch(
    std::unique_lock<std::mutex>& lock, std::vector<std::pair<Queued, absl::Status>>* dropped) {
  std::vector<Queued> batch;
  // Moves live jobs that `fits` accepts from the queue into the batch, and dead ones to dropped.
  auto take = [&](auto fits) {
    const absl::Time now = absl::Now();
    for (auto it = queue_.begin();
         it != queue_.end() && static_cast<int>(batch.size()) < options_.max_batch;) {
      if (absl::Status why = DropReason(it->first, now, now - it->second); !why.ok()) {
        dropped->emplace_back(std::move(*it), std::move(why));
      } else if (fits(it->first.params)) {
        batch.push_back(std::move(*it));
      } else {
        ++it;
        continue;
      }
      it = queue_.erase(it);
    }
  };
  // The oldest live job leads.
  while (batch.empty() && !queue_.empty()) {
    const absl::Time now = absl::Now();
    Queued front = std::move(queue_.front());
    queue_.pop_front();
    if (absl::Status why = DropReason(front.first, now, now - front.second); !why.ok()) {
      dropped->emplace_back(std::move(front), std::move(why));
    } else {
      batch.push_back(std::move(front));
    }
  }
  if (batch.empty() || options_.max_batch == 1) return batch;
  const Executor& rules = *slots_.front().executor;
  const AttentionParams lead = batch.front().first.params;
  const absl::Time until = batch.front().second + options_.max_queue_delay;
  collecting_ = true;
  while (true) {
    take([&](const AttentionParams& p) { return rules.CanShareLaunch(lead, p); });
    if (static_cast<int>(batch.size()) >= options_.max_batch || stopping_ || absl::Now() >= until) {
      break;
    }
    arrivals_.wait_until(lock, absl::ToChronoTime(until));
  }
  collecting_ = false;
  return batch;
}

void Scheduler::CheckHealth(Slot* slot) {
  // Outside the lock: the executor may probe its device.
  absl::Status health = slot->executor->Health();
  if (health.ok()) return;
  int in_service = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!slot->lost.ok()) return;  // another worker took it out already
    slot->lost = health;
    in_service = CountInService();
  }
  const DeviceDescription& device = slot->executor->device();
  std::fprintf(stderr, "attention_server: %s taken out of service (%d left): %s\n",
               device.name.c_str(), in_service, health.ToString().c_str());
  if (options_.on_device_lost) options_.on_device_lost(device, health, in_service);
}

void Scheduler::RunBatch(std::vector<Queued> batch) {
  Slot* slot = nullptr;
  absl::Status no_device;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = AcquireLeastLoaded();
    if (slot == nullptr) no_device = NoDeviceError();
  }
  const absl::Time start = absl::Now();
  if (slot == nullptr) {
    for (Queued& queued : batch) {
      std::move(queued.first.done)(JobResult{.status = no_device, .queued = start - queued.second});
    }
    return;
  }
  std::vector<AttentionParams> params;
  for (const Queued& queued : batch) params.push_back(queued.first.params);
  std::vector<absl::StatusOr<StageTimes>> stages = slot->executor->RunBatch(params);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Release(slot);
  }
  if (std::any_of(stages.begin(), stages.end(), [](const auto& s) { return !s.ok(); })) {
    CheckHealth(slot);
  }
  const DeviceDescription& device = slot->executor->device();
  if (stages.size() != batch.size()) {
    stages.assign(batch.size(),
                  absl::InternalError(absl::StrCat("executor answered ", stages.size(),
                                                   " results for a batch of ", batch.size())));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    JobResult result;
    result.queued = start - batch[i].second;
    result.device = &device;
    result.batch_size = static_cast<int>(batch.size());
    result.leads_batch = i == 0;
    if (stages[i].ok()) {
      result.stages = *stages[i];
    } else {
      result.status = stages[i].status();
    }
    std::move(batch[i].first.done)(std::move(result));
  }
}

void Scheduler::WorkerLoop() {
  while (true) {
    std::vector<Queued> batch;
    std::vector<std::pair<Queued, absl::Status>> dropped;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Queued work is finished even when stopping: callers are still waiting for it.
      work_or_stopping_.wait(lock, [this] {
        return (!queue_.empty() && !collecting_) || (stopping_ && queue_.empty());
      });
      if (queue_.empty()) return;
      batch = CollectBatch(lock, &dropped);
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
    }
    // Another worker may collect what is left while this one runs.
    work_or_stopping_.notify_one();
    for (auto& [queued, why] : dropped) {
      JobResult result;
      result.status = std::move(why);
      result.queued = absl::Now() - queued.second;
      std::move(queued.first.done)(std::move(result));
    }
    if (!batch.empty()) RunBatch(std::move(batch));
  }
}

}  // namespace attention::server
