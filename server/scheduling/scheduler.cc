#include "server/scheduling/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <variant>
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
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

Scheduler::~Scheduler() { Shutdown(); }

void Scheduler::Submit(Job job) {
  std::vector<Job> jobs;
  jobs.push_back(std::move(job));
  SubmitAll(std::move(jobs));
}

absl::Status Scheduler::RefusalLocked(const Job& job, int more) const {
  const bool pinned = !std::holds_alternative<AttentionParams>(job.work);
  if (!aborted_.ok()) return aborted_;
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (job.device >= static_cast<int>(slots_.size()) || job.device < -1 ||
      (pinned && job.device < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("job device: expected an executor index 0..",
                                                   slots_.size() - 1, pinned ? "" : " or -1",
                                                   ", got ", job.device));
  }
  if (job.device >= 0 && !slots_[job.device].lost.ok()) return LostError(slots_[job.device]);
  if (CountInService() == 0) return NoDeviceError();
  if (static_cast<int>(queue_.size()) + more > options_.max_queue) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full: ", queue_.size(), " queued, limit ", options_.max_queue,
                     more > 1 ? absl::StrCat(", this call needs ", more) : ""));
  }
  return absl::OkStatus();
}

void Scheduler::SubmitAll(std::vector<Job> jobs) {
  absl::Status refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Job& job : jobs) {
      refusal = RefusalLocked(job, static_cast<int>(jobs.size()));
      if (!refusal.ok()) break;
    }
    if (refusal.ok()) {
      const absl::Time now = absl::Now();
      for (Job& job : jobs) queue_.emplace_back(std::move(job), now);
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
      submissions_.fetch_add(1, std::memory_order_release);
      // One job and a spinning worker: it takes the job, checking the queue under mu_ before it
      // could sleep, so nobody is woken.
      if (jobs.size() > 1) {
        work_or_stopping_.notify_all();
      } else if (!spinning_) {
        work_or_stopping_.notify_one();
      }
      arrivals_.notify_one();
      return;
    }
  }
  for (Job& job : jobs) std::move(job.done)(JobResult{.status = refusal});
}

void Scheduler::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    submissions_.fetch_add(1, std::memory_order_release);  // ends a spin
  }
  work_or_stopping_.notify_all();
  arrivals_.notify_all();
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    watchdog_stop_ = true;
  }
  watch_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void Scheduler::Abort(absl::Status why) {
  std::deque<Queued> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = why;
    dropped.swap(queue_);
    if (on_queue_depth_) on_queue_depth_(0);
    for (Running* running : running_) running->stop = true;
  }
  work_or_stopping_.notify_all();
  arrivals_.notify_all();
  const absl::Time now = absl::Now();
  for (Queued& queued : dropped) {
    std::move(queued.first.done)(JobResult{.status = why, .queued = now - queued.second});
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

absl::Status Scheduler::LostError(const Slot& slot) {
  return absl::UnavailableError(
      absl::StrCat(slot.executor->device().name, " is out of service: ", slot.lost.message()));
}

absl::Status Scheduler::NoDeviceError() const {
  std::string why;
  for (const Slot& slot : slots_) {
    absl::StrAppend(&why, why.empty() ? "" : "; ", slot.executor->device().name, ": ",
                    slot.lost.message());
  }
  return absl::UnavailableError(absl::StrCat("every device is out of service (", why, ")"));
}

Scheduler::Slot* Scheduler::AcquireSlot(int device) {
  Slot* best = nullptr;
  if (device >= 0) {
    if (slots_[device].lost.ok()) best = &slots_[device];
  } else {
    for (Slot& slot : slots_) {
      if (slot.lost.ok() && (best == nullptr || slot.in_flight < best->in_flight)) best = &slot;
    }
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
// Why nobody waits for `job` any more (its deadline passed, its caller cancelled), or OK.
// `queued`: how long it has waited in the queue; nullopt once it runs.
absl::Status NobodyWaits(const Job& job, absl::Time now, std::optional<absl::Duration> queued) {
  const auto where = [&queued] {
    return queued ? absl::StrCat("queued for ", absl::FormatDuration(*queued))
                  : std::string("running; the run was stopped");
  };
  // The deadline first: a call past its deadline is also cancelled, and the deadline says why.
  if (now >= job.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("deadline passed while ", where()));
  }
  if (job.cancelled && job.cancelled()) {
    return absl::CancelledError(absl::StrCat("cancelled by the client while ", where()));
  }
  return absl::OkStatus();
}

}  // namespace

bool Scheduler::RunnableLocked(const Job& job) const {
  return std::none_of(job.sessions.begin(), job.sessions.end(),
                      [this](absl::string_view id) { return held_sessions_.contains(id); });
}

bool Scheduler::AnyRunnableLocked() const {
  return std::any_of(queue_.begin(), queue_.end(),
                     [this](const Queued& queued) { return RunnableLocked(queued.first); });
}

bool Scheduler::CanJoin(const std::vector<Queued>& batch, const Job& job) const {
  const Job& lead = batch.front().first;
  if (lead.work.index() != job.work.index() || lead.device != job.device) return false;
  if (const auto* params = std::get_if<AttentionParams>(&job.work)) {
    return slots_.front().executor->CanShareLaunch(std::get<AttentionParams>(lead.work), *params);
  }
  // One launch holds each session once: a job sharing one with the batch is not asked, as its
  // members' sessions are held (RunnableLocked).
  const auto* decode = std::get_if<DecodeWork>(&job.work);
  return decode != nullptr && decode->key == std::get<DecodeWork>(lead.work).key;
}

std::vector<Scheduler::Queued> Scheduler::CollectBatch(
    std::unique_lock<std::mutex>& lock, std::vector<std::pair<Queued, absl::Status>>* dropped) {
  std::vector<Queued> batch;
  // Moves live jobs that `fits` accepts from the queue into the batch, and dead ones to dropped.
  // Jobs whose sessions are held stay queued, and so do later jobs on the same sessions.
  auto take = [&](auto fits) {
    const absl::Time now = absl::Now();
    for (auto it = queue_.begin();
         it != queue_.end() && static_cast<int>(batch.size()) < options_.max_batch;) {
      if (absl::Status why = NobodyWaits(it->first, now, now - it->second); !why.ok()) {
        dropped->emplace_back(std::move(*it), std::move(why));
      } else if (RunnableLocked(it->first) && fits(it->first)) {
        held_sessions_.insert(it->first.sessions.begin(), it->first.sessions.end());
        batch.push_back(std::move(*it));
      } else {
        ++it;
        continue;
      }
      it = queue_.erase(it);
    }
  };
  // The oldest runnable live job leads.
  take([&](const Job&) { return batch.empty(); });
  if (batch.empty() || options_.max_batch == 1 ||
      std::holds_alternative<DeviceWork>(batch.front().first.work)) {
    return batch;
  }
  const absl::Time until = batch.front().second + options_.max_queue_delay;
  collecting_ = true;
  while (true) {
    take([&](const Job& job) { return CanJoin(batch, job); });
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

std::vector<absl::StatusOr<StageTimes>> Scheduler::RunForward(Executor& executor,
                                                              std::vector<Queued>& batch,
                                                              const std::atomic<bool>* stop) {
  std::vector<AttentionParams> params;
  for (const Queued& queued : batch) {
    params.push_back(std::get<AttentionParams>(queued.first.work));
    params.back().stop = stop;
  }
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<StageTimes>> results = executor.RunBatch(params);
  const double run_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  for (absl::StatusOr<StageTimes>& times : results) {
    if (times.ok()) times->run_us = run_us;
  }
  return results;
}

std::vector<absl::StatusOr<StageTimes>> Scheduler::RunDecode(Executor& executor,
                                                             std::vector<Queued>& batch,
                                                             const std::atomic<bool>* stop) {
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<StageTimes>> results(batch.size());
  std::vector<DecodeSequence> seqs;
  std::vector<size_t> prepared;  // jobs whose sequences are in `seqs`
  for (size_t i = 0; i < batch.size(); ++i) {
    absl::StatusOr<std::vector<DecodeSequence>> job_seqs =
        std::move(std::get<DecodeWork>(batch[i].first.work).prepare)();
    if (!job_seqs.ok()) {
      results[i] = job_seqs.status();
      continue;
    }
    seqs.insert(seqs.end(), job_seqs->begin(), job_seqs->end());
    prepared.push_back(i);
  }
  if (prepared.empty()) return results;
  const DecodePlan plan(std::get<DecodeWork>(batch.front().first.work).key, std::move(seqs));
  PagedDecodeParams params = plan.params();
  params.stop = stop;
  const absl::Time planned = absl::Now();
  absl::StatusOr<StageTimes> times = executor.RunDecode(params);
  if (times.ok()) {
    times->prepare_us = absl::ToDoubleMicroseconds(planned - start);
    times->run_us = absl::ToDoubleMicroseconds(absl::Now() - planned);
  }
  for (size_t i : prepared) results[i] = times;
  return results;
}

void Scheduler::RunBatch(std::vector<Queued> batch) {
  const Job& lead = batch.front().first;
  Slot* slot = nullptr;
  absl::Status no_device;
  Running running{.batch = &batch};
  bool wake_watchdog = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = AcquireSlot(lead.device);
    if (slot == nullptr) {
      no_device = lead.device >= 0 ? LostError(slots_[lead.device]) : NoDeviceError();
    } else {
      running.stop = !aborted_.ok();
      running_.push_back(&running);
      // The watchdog sleeps while nothing runs; wake it for the first batch only.
      wake_watchdog = running_.size() == 1;
    }
  }
  if (wake_watchdog) watch_.notify_one();
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<StageTimes>> stages;
  if (slot != nullptr) {
    Executor& executor = *slot->executor;
    if (std::holds_alternative<AttentionParams>(lead.work)) {
      stages = RunForward(executor, batch, &running.stop);
    } else if (std::holds_alternative<DecodeWork>(lead.work)) {
      stages = RunDecode(executor, batch, &running.stop);
    } else {
      stages.push_back(std::move(std::get<DeviceWork>(batch.front().first.work).run)());
    }
    absl::Status aborted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Release(slot);
      running_.erase(std::find(running_.begin(), running_.end(), &running));
      aborted = aborted_;
    }
    if (stages.size() != batch.size()) {
      stages.assign(batch.size(),
                    absl::InternalError(absl::StrCat("executor answered ", stages.size(),
                                                     " results for a batch of ", batch.size())));
    }
    if (running.stop) {
      // Stopped, not failed: each job that did not finish is told why nobody waited for it.
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < batch.size(); ++i) {
        if (stages[i].ok()) continue;
        absl::Status why = aborted.ok() ? NobodyWaits(batch[i].first, now, std::nullopt) : aborted;
        if (!why.ok()) stages[i] = std::move(why);
      }
    } else if (std::any_of(stages.begin(), stages.end(), [](const auto& s) { return !s.ok(); })) {
      CheckHealth(slot);
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    JobResult result;
    result.queued = start - batch[i].second;
    if (slot == nullptr) {
      result.status = no_device;
    } else {
      result.device = &slot->executor->device();
      result.batch_size = static_cast<int>(batch.size());
      result.leads_batch = i == 0;
      if (stages[i].ok()) {
        result.stages = *stages[i];
      } else {
        result.status = stages[i].status();
      }
    }
    std::move(batch[i].first.done)(std::move(result));
  }
  // After the answers, which end the jobs' holds on their sessions: jobs queued behind them may
  // run, so the workers are woken, when some wait in the queue (or all are told to stop).
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Queued& queued : batch) {
      for (absl::string_view id : queued.first.sessions) held_sessions_.erase(id);
    }
    wake = stopping_ || AnyRunnableLocked();
  }
  if (wake) work_or_stopping_.notify_all();
}

void Scheduler::WatchdogLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!watchdog_stop_) {
    if (running_.empty()) {
      watch_.wait(lock, [this] { return watchdog_stop_ || !running_.empty(); });
      continue;
    }
    watch_.wait_for(lock, absl::ToChronoNanoseconds(kStopPoll));
    const absl::Time now = absl::Now();
    for (Running* running : running_) {
      if (running->stop) continue;
      // A batch stops only when none of its jobs has a caller left: the others still want it.
      const bool nobody_waits =
          std::all_of(running->batch->begin(), running->batch->end(), [now](const Queued& queued) {
            return !NobodyWaits(queued.first, now, std::nullopt).ok();
          });
      if (nobody_waits) running->stop = true;
    }
  }
}

void Scheduler::Spin(std::unique_lock<std::mutex>& lock) {
  if (options_.worker_spin <= absl::ZeroDuration() || spinning_ || stopping_ ||
      (!collecting_ && AnyRunnableLocked())) {
    return;
  }
  spinning_ = true;
  const uint64_t seen = submissions_.load(std::memory_order_acquire);
  lock.unlock();
  const auto until =
      std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.worker_spin);
  while (submissions_.load(std::memory_order_acquire) == seen &&
         std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  lock.lock();
  spinning_ = false;
}

void Scheduler::WorkerLoop() {
  while (true) {
    std::vector<Queued> batch;
    std::vector<std::pair<Queued, absl::Status>> dropped;
    bool wake_another = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      Spin(lock);
      // Queued work is finished even when stopping: callers are still waiting for it.
      work_or_stopping_.wait(lock, [this] {
        return (!collecting_ && AnyRunnableLocked()) || (stopping_ && queue_.empty());
      });
      if (queue_.empty()) return;
      batch = CollectBatch(lock, &dropped);
      if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
      wake_another = stopping_ || AnyRunnableLocked();
    }
    // Another worker may collect what is left while this one runs. Only then: a worker woken for
    // nothing contends for mu_ with the next job's submission, and a one-in-flight caller's next
    // request waited in the queue for it (bench/results/2026-12-02-request-rings.md).
    if (wake_another) work_or_stopping_.notify_one();
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
