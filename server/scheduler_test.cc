#include "server/scheduler.h"

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/run_gate_for_tests.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// An executor whose runs block until Release(); it counts the runs it started.
class GatedExecutor final : public Executor {
 public:
  explicit GatedExecutor(std::string name) { device_.name = std::move(name); }
  const DeviceDescription& device() const override { return device_; }
  absl::StatusOr<StageTimes> Run(const AttentionParams&) override {
    gate_.Pass();
    absl::MutexLock lock(&mu_);
    if (!fail_with_.ok()) return fail_with_;
    return StageTimes{.compute_us = 1};
  }
  void Release() { gate_.Open(); }
  void FailWith(absl::Status status) {
    absl::MutexLock lock(&mu_);
    fail_with_ = std::move(status);
  }
  // Blocks until `n` runs have started.
  void AwaitStarted(int n) { gate_.AwaitStarted(n); }
  int started() { return gate_.started(); }

 private:
  DeviceDescription device_;
  RunGate gate_;
  absl::Mutex mu_;
  absl::Status fail_with_ ABSL_GUARDED_BY(mu_);
};

// Collects one job's result.
struct Outcome {
  absl::Notification done;
  JobResult result;

  Job MakeJob() {
    Job job;
    job.done = [this](JobResult r) {
      result = std::move(r);
      done.Notify();
    };
    return job;
  }
};

struct Fixture {
  explicit Fixture(int executors, const SchedulerOptions& options) {
    std::vector<std::unique_ptr<Executor>> owned;
    for (int i = 0; i < executors; ++i) {
      auto executor = std::make_unique<GatedExecutor>("dev" + std::to_string(i));
      gates.push_back(executor.get());
      owned.push_back(std::move(executor));
    }
    scheduler.emplace(std::move(owned), options);
  }
  void ReleaseAll() {
    for (GatedExecutor* gate : gates) gate->Release();
  }
  std::vector<GatedExecutor*> gates;
  std::optional<Scheduler> scheduler;
};

TEST(SchedulerTest, FullQueueIsRefusedAtOnce) {
  Fixture f(1, {.workers = 1, .max_queue = 1});
  Outcome running, queued, refused;
  f.scheduler->Submit(running.MakeJob());
  f.gates[0]->AwaitStarted(1);            // the worker holds `running`
  f.scheduler->Submit(queued.MakeJob());  // fills the queue
  EXPECT_EQ(f.scheduler->queue_depth(), 1);
  f.scheduler->Submit(refused.MakeJob());
  ASSERT_TRUE(refused.done.HasBeenNotified());  // answered inside Submit
  EXPECT_EQ(refused.result.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.result.status.message(), HasSubstr("queue full: 1 queued, limit 1"));
  EXPECT_EQ(refused.result.device, nullptr);

  f.ReleaseAll();
  running.done.WaitForNotification();
  queued.done.WaitForNotification();
  EXPECT_TRUE(running.result.status.ok()) << running.result.status;
  EXPECT_TRUE(queued.result.status.ok()) << queued.result.status;
  EXPECT_EQ(queued.result.device->name, "dev0");
  EXPECT_EQ(queued.result.stages.compute_us, 1);
}

TEST(SchedulerTest, CancelledAndExpiredJobsNeverReachTheExecutor) {
  Fixture f(1, {.workers = 1, .max_queue = 4});
  Outcome blocker, cancelled, expired, alive;
  f.scheduler->Submit(blocker.MakeJob());
  f.gates[0]->AwaitStarted(1);

  std::atomic<bool> client_gone{false};
  Job cancelled_job = cancelled.MakeJob();
  cancelled_job.cancelled = [&client_gone] { return client_gone.load(); };
  f.scheduler->Submit(std::move(cancelled_job));

  Job expired_job = expired.MakeJob();
  expired_job.deadline = absl::Now() + absl::Milliseconds(1);
  f.scheduler->Submit(std::move(expired_job));

  f.scheduler->Submit(alive.MakeJob());

  client_gone = true;
  absl::SleepFor(absl::Milliseconds(5));  // past the deadline
  f.ReleaseAll();
  for (Outcome* o : {&blocker, &cancelled, &expired, &alive}) o->done.WaitForNotification();

  EXPECT_EQ(cancelled.result.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(expired.result.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.result.device, nullptr);
  EXPECT_GE(expired.result.queued, absl::Milliseconds(1));
  EXPECT_TRUE(alive.result.status.ok()) << alive.result.status;
  EXPECT_EQ(f.gates[0]->started(), 2);  // blocker and alive only
}

TEST(SchedulerTest, SpreadsJobsOverTheLeastLoadedExecutors) {
  Fixture f(2, {.workers = 2, .max_queue = 4});
  Outcome a, b;
  f.scheduler->Submit(a.MakeJob());
  f.scheduler->Submit(b.MakeJob());
  // Each executor gets one: neither run finishes until both have started.
  f.gates[0]->AwaitStarted(1);
  f.gates[1]->AwaitStarted(1);
  f.ReleaseAll();
  a.done.WaitForNotification();
  b.done.WaitForNotification();
  EXPECT_NE(a.result.device, b.result.device);
}

TEST(SchedulerTest, ExecutorErrorsReachTheCaller) {
  Fixture f(1, {.workers = 1, .max_queue = 4});
  f.gates[0]->FailWith(absl::InternalError("device fault: cudaErrorIllegalAddress"));
  f.ReleaseAll();
  Outcome o;
  f.scheduler->Submit(o.MakeJob());
  o.done.WaitForNotification();
  EXPECT_EQ(o.result.status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(o.result.status.message(), HasSubstr("cudaErrorIllegalAddress"));
}

TEST(SchedulerTest, ShutdownFinishesQueuedWorkAndRefusesNew) {
  Fixture f(1, {.workers = 1, .max_queue = 4});
  Outcome running, queued, late;
  f.scheduler->Submit(running.MakeJob());
  f.gates[0]->AwaitStarted(1);
  f.scheduler->Submit(queued.MakeJob());
  absl::Notification shut;
  std::thread stopper([&] {
    f.scheduler->Shutdown();
    shut.Notify();
  });
  // Shutdown waits for the queued job, so it cannot have returned yet.
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_FALSE(shut.HasBeenNotified());
  f.ReleaseAll();
  stopper.join();
  EXPECT_TRUE(queued.result.status.ok()) << queued.result.status;
  f.scheduler->Submit(late.MakeJob());
  ASSERT_TRUE(late.done.HasBeenNotified());
  EXPECT_EQ(late.result.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(late.result.status.message(), HasSubstr("shutting down"));
}

}  // namespace
}  // namespace attention::server
