#include "server/scheduling/scheduler.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/notification_for_tests.h"
#include "server/testing/run_gate_for_tests.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// The head dim that makes GatedExecutor fail a launch, as a device fault would.
constexpr int64_t kFaultyHeadDim = 13;

// An executor whose runs block until Release(); it counts the runs (launches) it started. Jobs
// with equal head dims share a launch; a launch holding kFaultyHeadDim fails as a whole.
class GatedExecutor final : public Executor {
 public:
  explicit GatedExecutor(std::string name) { device_.name = std::move(name); }
  const DeviceDescription& device() const override { return device_; }
  absl::StatusOr<StageTimes> Run(const AttentionParams& params) override {
    return RunBatch(absl::MakeConstSpan(&params, 1)).front();
  }
  bool CanShareLaunch(const AttentionParams& a, const AttentionParams& b) const override {
    return a.head_dim == b.head_dim;
  }
  std::vector<absl::StatusOr<StageTimes>> RunBatch(
      absl::Span<const AttentionParams> items) override {
    gate_.Pass();
    std::lock_guard<std::mutex> lock(mu_);
    launch_sizes_.push_back(static_cast<int>(items.size()));
    absl::StatusOr<StageTimes> result = StageTimes{.compute_us = 1};
    if (!fail_with_.ok()) result = fail_with_;
    for (const AttentionParams& item : items) {
      if (item.head_dim == kFaultyHeadDim) result = absl::InternalError("device fault in launch");
    }
    return std::vector<absl::StatusOr<StageTimes>>(items.size(), result);
  }
  absl::Status Health() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++health_checks_;
    return health_;
  }
  // Health answers `status` from now on, as a device with a corrupted context would.
  void Lose(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    health_ = std::move(status);
  }
  int health_checks() {
    std::lock_guard<std::mutex> lock(mu_);
    return health_checks_;
  }
  void Release() { gate_.Open(); }
  void FailWith(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_with_ = std::move(status);
  }
  // Blocks until `n` runs have started.
  void AwaitStarted(int n) { gate_.AwaitStarted(n); }
  int started() { return gate_.started(); }
  std::vector<int> launch_sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    return launch_sizes_;
  }

 private:
  DeviceDescription device_;
  RunGate gate_;
  std::mutex mu_;  // guards the two below; a pthread lock, which ThreadSanitizer sees
  absl::Status fail_with_;
  absl::Status health_;
  int health_checks_ = 0;
  std::vector<int> launch_sizes_;

 protected:
  // A pool that writes, copies and reads nothing and records each decode launch's sequence count.
  absl::StatusOr<std::unique_ptr<KvPagePool>> CreateKvPagePool(int64_t num_pages,
                                                               int64_t page_bytes) override {
    class RecordingPool final : public KvPagePool {
     public:
      explicit RecordingPool(GatedExecutor* executor) : executor_(executor) {}
      int64_t page_bytes() const override { return 4096; }
      int64_t num_pages() const override { return 1; }
      absl::Status Write(absl::Span<const KvWrite>) override { return absl::OkStatus(); }
      absl::Status CopyPages(absl::Span<const std::pair<int32_t, int32_t>>) override {
        return absl::OkStatus();
      }
      absl::Status Read(const KvRead&) override { return absl::OkStatus(); }
      absl::StatusOr<KvStepTimes> Decode(const PagedDecodeParams& p) override {
        if (executor_->on_decode_) executor_->on_decode_();
        std::lock_guard<std::mutex> lock(executor_->mu_);
        executor_->decode_launches_.push_back(static_cast<int>(p.num_seqs));
        return KvStepTimes{.compute_us = 2};
      }

     private:
      GatedExecutor* const executor_;
    };
    return std::make_unique<RecordingPool>(this);
  }

 public:
  // Called at the start of each decode launch, outside the executor's lock. Set before any runs.
  void OnDecode(std::function<void()> hook) { on_decode_ = std::move(hook); }
  // The sequence counts of the decode launches so far.
  std::vector<int> decode_launches() {
    std::lock_guard<std::mutex> lock(mu_);
    return decode_launches_;
  }

 private:
  std::vector<int> decode_launches_;  // guarded by mu_
  std::function<void()> on_decode_;
};

// Collects one job's result.
struct Outcome {
  Notification done;
  JobResult result;

  Job MakeJob(int64_t head_dim = 0) {
    Job job;
    AttentionParams params;
    params.head_dim = head_dim;
    job.work = params;
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
      EXPECT_TRUE(executor->InitKvPool(1, 4096).ok());
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
  Notification shut;
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

TEST(SchedulerTest, BatchesCompatibleQueuedJobsUpToMaxBatch) {
  Fixture f(1, {.workers = 1, .max_queue = 16, .max_batch = 3});
  Outcome blocker, a[4], other;
  f.scheduler->Submit(blocker.MakeJob(64));
  f.gates[0]->AwaitStarted(1);  // the worker holds the blocker; the rest queue up
  for (Outcome& o : a) f.scheduler->Submit(o.MakeJob(64));
  f.scheduler->Submit(other.MakeJob(128));
  f.ReleaseAll();
  for (Outcome& o : a) o.done.WaitForNotification();
  other.done.WaitForNotification();

  // The blocker alone, three of the four head-dim-64 jobs together, then the fourth alone (the
  // head-dim-128 job cannot join it), then the head-dim-128 job.
  EXPECT_EQ(f.gates[0]->launch_sizes(), (std::vector<int>{1, 3, 1, 1}));
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(a[i].result.status.ok()) << a[i].result.status;
    EXPECT_EQ(a[i].result.batch_size, 3);
    EXPECT_EQ(a[i].result.leads_batch, i == 0);
  }
  EXPECT_EQ(a[3].result.batch_size, 1);
  EXPECT_EQ(other.result.batch_size, 1);
  EXPECT_TRUE(other.result.status.ok()) << other.result.status;
}

TEST(SchedulerTest, FullBatchRunsWithoutWaitingOutTheDelay) {
  Fixture f(1,
            {.workers = 1, .max_queue = 16, .max_batch = 4, .max_queue_delay = absl::Seconds(30)});
  f.ReleaseAll();
  const absl::Time start = absl::Now();
  Outcome o[4];
  f.scheduler->Submit(o[0].MakeJob(64));
  absl::SleepFor(absl::Milliseconds(20));  // the worker is now waiting for companions
  for (int i = 1; i < 4; ++i) f.scheduler->Submit(o[i].MakeJob(64));
  for (Outcome& x : o) x.done.WaitForNotification();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(f.gates[0]->launch_sizes(), (std::vector<int>{4}));
  EXPECT_GE(o[0].result.queued, absl::Milliseconds(20));
}

TEST(SchedulerTest, PartialBatchRunsWhenTheDelayEnds) {
  Fixture f(
      1,
      {.workers = 1, .max_queue = 16, .max_batch = 8, .max_queue_delay = absl::Milliseconds(30)});
  f.ReleaseAll();
  Outcome alone;
  f.scheduler->Submit(alone.MakeJob(64));
  alone.done.WaitForNotification();
  EXPECT_TRUE(alone.result.status.ok()) << alone.result.status;
  EXPECT_EQ(alone.result.batch_size, 1);
  EXPECT_GE(alone.result.queued, absl::Milliseconds(30));
}

TEST(SchedulerTest, DeadJobsAreLeftOutOfBatches) {
  Fixture f(1, {.workers = 1, .max_queue = 16, .max_batch = 4});
  Outcome blocker, first, cancelled, last;
  f.scheduler->Submit(blocker.MakeJob(64));
  f.gates[0]->AwaitStarted(1);
  f.scheduler->Submit(first.MakeJob(64));
  Job gone = cancelled.MakeJob(64);
  gone.cancelled = [] { return true; };
  f.scheduler->Submit(std::move(gone));
  f.scheduler->Submit(last.MakeJob(64));
  f.ReleaseAll();
  for (Outcome* o : {&first, &cancelled, &last}) o->done.WaitForNotification();
  EXPECT_EQ(cancelled.result.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cancelled.result.device, nullptr);
  EXPECT_EQ(first.result.batch_size, 2);
  EXPECT_EQ(last.result.batch_size, 2);
  EXPECT_EQ(f.gates[0]->launch_sizes(), (std::vector<int>{1, 2}));
}

TEST(SchedulerTest, AFailedLaunchFailsOnlyItsOwnJobs) {
  Fixture f(1, {.workers = 1, .max_queue = 16, .max_batch = 2});
  Outcome blocker, faulty, companion, healthy;
  f.scheduler->Submit(blocker.MakeJob(64));
  f.gates[0]->AwaitStarted(1);
  f.scheduler->Submit(faulty.MakeJob(kFaultyHeadDim));
  f.scheduler->Submit(companion.MakeJob(kFaultyHeadDim));
  f.scheduler->Submit(healthy.MakeJob(64));
  f.ReleaseAll();
  for (Outcome* o : {&faulty, &companion, &healthy}) o->done.WaitForNotification();
  EXPECT_EQ(faulty.result.status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(companion.result.status.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(healthy.result.status.ok()) << healthy.result.status;
  EXPECT_TRUE(blocker.result.status.ok()) << blocker.result.status;
}

TEST(SchedulerTest, ALostDeviceLeavesRotationAndTheLastOneLeavesUnavailable) {
  std::vector<std::pair<std::string, int>> lost;  // device, devices in service after
  std::mutex lost_mu;
  Fixture f(2, {.workers = 1,
                .max_queue = 16,
                .on_device_lost = [&](const DeviceDescription& device, const absl::Status& why,
                                      int in_service) {
                  EXPECT_THAT(why.message(), HasSubstr("context lost"));
                  std::lock_guard<std::mutex> lock(lost_mu);
                  lost.emplace_back(device.name, in_service);
                }});
  f.ReleaseAll();
  // A successful run asks nothing; a failed one asks the executor's health.
  Outcome fine;
  f.scheduler->Submit(fine.MakeJob(64));
  fine.done.WaitForNotification();
  EXPECT_EQ(f.gates[0]->health_checks() + f.gates[1]->health_checks(), 0);

  // dev0 (the least loaded: the first one) faults and loses its context.
  f.gates[0]->Lose(absl::InternalError("context lost on dev0"));
  f.gates[0]->FailWith(absl::InternalError("illegal address"));
  Outcome faulty;
  f.scheduler->Submit(faulty.MakeJob(64));
  faulty.done.WaitForNotification();
  EXPECT_EQ(faulty.result.status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(faulty.result.device->name, "dev0");
  EXPECT_EQ(f.scheduler->devices_in_service(), 1);
  std::vector<DeviceLoad> loads = f.scheduler->device_loads();
  EXPECT_THAT(loads[0].lost.message(), HasSubstr("context lost on dev0"));
  EXPECT_TRUE(loads[1].lost.ok());

  // Everything now runs on dev1, which stays in service after an ordinary failed launch.
  const int dev0_runs = f.gates[0]->started();
  for (int i = 0; i < 4; ++i) {
    Outcome o;
    f.scheduler->Submit(o.MakeJob(i == 0 ? kFaultyHeadDim : 64));
    o.done.WaitForNotification();
    EXPECT_EQ(o.result.device->name, "dev1");
    EXPECT_EQ(o.result.status.ok(), i != 0) << o.result.status;
  }
  EXPECT_EQ(f.gates[0]->started(), dev0_runs);
  EXPECT_EQ(f.scheduler->devices_in_service(), 1);

  // dev1 is lost too: new jobs are refused at once, naming both devices.
  f.gates[1]->Lose(absl::InternalError("context lost on dev1"));
  Outcome last, refused;
  f.scheduler->Submit(last.MakeJob(kFaultyHeadDim));
  last.done.WaitForNotification();
  EXPECT_EQ(f.scheduler->devices_in_service(), 0);
  f.scheduler->Submit(refused.MakeJob(64));
  ASSERT_TRUE(refused.done.HasBeenNotified());
  EXPECT_EQ(refused.result.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.result.status.message(),
              HasSubstr("every device is out of service (dev0: context lost on dev0; dev1: "
                        "context lost on dev1)"));
  std::lock_guard<std::mutex> lock(lost_mu);
  EXPECT_EQ(lost, (std::vector<std::pair<std::string, int>>{{"dev0", 1}, {"dev1", 0}}));
}

}  // namespace
}  // namespace attention::server

namespace attention::server {
namespace {

// A decode job over one one-query sequence of session `id` (shape f32, Hkv 1, D 1) with `key`;
// its q, o and page table live here.
struct DecodeOutcome : Outcome {
  float q = 1, o = 0;
  int32_t page = 0;

  Job MakeDecodeJob(const std::string& id, const DecodeKey& key) {
    Job job = MakeJob();
    job.device = 0;
    auto kept = std::make_shared<const std::string>(id);
    job.sessions = {*kept};
    job.keeps = std::move(kept);
    job.work = DecodeWork{
        .key = key, .prepare = [this]() -> absl::StatusOr<std::vector<DecodeSequence>> {
          return std::vector<DecodeSequence>{
              {.pages = absl::MakeConstSpan(&page, 1), .length = 1, .q = &q, .rows_q = 1, .o = &o}};
        }};
    return job;
  }
};

DecodeKey TinyKey(float scale) {
  return DecodeKey{.shape = {.dtype = DType::kFloat32, .heads_kv = 1, .head_dim = 1},
                   .heads_q = 1,
                   .softmax_scale = scale};
}

TEST(SchedulerTest, DecodeStepsWithEqualKeysAndOtherSessionsShareOneLaunch) {
  Fixture f(1, {.workers = 1, .max_queue = 16, .max_batch = 8});
  Outcome blocker;
  f.scheduler->Submit(blocker.MakeJob());
  f.gates[0]->AwaitStarted(1);
  DecodeOutcome s1, s2, other_key, s1_again;
  f.scheduler->Submit(s1.MakeDecodeJob("s1", TinyKey(1)));
  f.scheduler->Submit(s2.MakeDecodeJob("s2", TinyKey(1)));
  f.scheduler->Submit(other_key.MakeDecodeJob("s3", TinyKey(0.5f)));
  f.scheduler->Submit(s1_again.MakeDecodeJob("s1", TinyKey(1)));
  f.ReleaseAll();
  for (Outcome* o : std::initializer_list<Outcome*>{&blocker, &s1, &s2, &other_key, &s1_again}) {
    o->done.WaitForNotification();
    EXPECT_TRUE(o->result.status.ok()) << o->result.status;
  }
  // s1 and s2 in one launch; the other key alone; s1's second step after its first, alone.
  EXPECT_EQ(f.gates[0]->decode_launches(), (std::vector<int>{2, 1, 1}));
  EXPECT_EQ(s1.result.batch_size, 2);
  EXPECT_TRUE(s1.result.leads_batch);
  EXPECT_FALSE(s2.result.leads_batch);
  EXPECT_EQ(s1.result.stages.compute_us, 2);
  EXPECT_EQ(s1_again.result.batch_size, 1);
}

// A Step whose sessions live on two devices is one decode job per device, queued together
// (SubmitAll): the two launches run at the same time, each on its own device, not one after the
// other. Each launch waits (up to 10 s) until the other has started too.
TEST(SchedulerTest, ADecodeStepOverTwoDevicesRunsOnBothAtOnce) {
  Fixture f(2, {.workers = 2, .max_queue = 16, .max_batch = 8});
  std::mutex mu;
  std::condition_variable entered_cv;
  int entered = 0;
  std::atomic<int> saw_both{0};
  auto meet = [&] {
    std::unique_lock<std::mutex> lock(mu);
    ++entered;
    entered_cv.notify_all();
    if (entered_cv.wait_for(lock, std::chrono::seconds(10), [&] { return entered >= 2; })) {
      ++saw_both;
    }
  };
  for (GatedExecutor* gate : f.gates) gate->OnDecode(meet);
  DecodeOutcome on0, on1;
  std::vector<Job> step;
  step.push_back(on0.MakeDecodeJob("a", TinyKey(1)));
  step.push_back(on1.MakeDecodeJob("b", TinyKey(1)));
  step.back().device = 1;
  f.scheduler->SubmitAll(std::move(step));
  for (DecodeOutcome* o : {&on0, &on1}) {
    o->done.WaitForNotification();
    EXPECT_TRUE(o->result.status.ok()) << o->result.status;
  }
  EXPECT_EQ(saw_both, 2) << "the two devices' launches ran one after the other";
  EXPECT_EQ(on0.result.device->name, "dev0");
  EXPECT_EQ(on1.result.device->name, "dev1");
  EXPECT_EQ(f.gates[0]->decode_launches(), (std::vector<int>{1}));
  EXPECT_EQ(f.gates[1]->decode_launches(), (std::vector<int>{1}));
}

TEST(SchedulerTest, JobsOnOneSessionRunOneAtATimeWhileOthersPass) {
  Fixture f(1, {.workers = 2, .max_queue = 16});
  Notification first_started, release_first;
  std::atomic<bool> first_done{false}, second_overlapped{false};
  auto device_job = [](Outcome& outcome, std::string id, absl::AnyInvocable<void()> body) {
    Job job = outcome.MakeJob();
    job.device = 0;
    auto kept = std::make_shared<const std::string>(std::move(id));
    job.sessions = {*kept};
    job.keeps = std::move(kept);
    job.work = DeviceWork{.run = [body = std::move(body)]() mutable -> absl::StatusOr<StageTimes> {
      body();
      return StageTimes{.h2d_us = 1};
    }};
    return job;
  };
  Outcome first, second, other;
  f.scheduler->Submit(device_job(first, "s", [&] {
    first_started.Notify();
    release_first.WaitForNotification();
    first_done = true;
  }));
  first_started.WaitForNotification();
  f.scheduler->Submit(device_job(second, "s", [&] { second_overlapped = !first_done; }));
  f.scheduler->Submit(device_job(other, "t", [] {}));
  // The second worker passes the held job and runs the one on another session.
  other.done.WaitForNotification();
  EXPECT_TRUE(other.result.status.ok()) << other.result.status;
  EXPECT_FALSE(second.done.HasBeenNotified());
  EXPECT_EQ(f.scheduler->queue_depth(), 1);
  release_first.Notify();
  second.done.WaitForNotification();
  EXPECT_TRUE(second.result.status.ok()) << second.result.status;
  EXPECT_FALSE(second_overlapped) << "two jobs on one session ran at once";
}

TEST(SchedulerTest, WorkOnALostDeviceIsUnavailable) {
  Fixture f(2, {.workers = 1});
  Outcome failed;
  f.gates[1]->Lose(absl::InternalError("context lost"));
  Job job = failed.MakeJob();
  job.device = 1;
  job.work = DeviceWork{
      .run = []() -> absl::StatusOr<StageTimes> { return absl::InternalError("device fault"); }};
  f.ReleaseAll();
  f.scheduler->Submit(std::move(job));
  failed.done.WaitForNotification();
  EXPECT_EQ(failed.result.status.code(), absl::StatusCode::kInternal);
  // The failure took dev1 out of rotation: work for its sessions is refused at once.
  DecodeOutcome decode;
  f.scheduler->Submit(decode.MakeDecodeJob("s", TinyKey(1)));
  Job on_lost = decode.MakeDecodeJob("s", TinyKey(1));
  on_lost.device = 1;
  Outcome refused;
  on_lost.done = [&refused](JobResult r) {
    refused.result = std::move(r);
    refused.done.Notify();
  };
  f.scheduler->Submit(std::move(on_lost));
  ASSERT_TRUE(refused.done.HasBeenNotified());
  EXPECT_EQ(refused.result.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.result.status.message(), HasSubstr("dev1 is out of service: context lost"));
  decode.done.WaitForNotification();
  EXPECT_TRUE(decode.result.status.ok()) << decode.result.status;
}

// An executor whose runs spin until their stop flag is set (as the CPU kernel checks between
// tiles), then answer as a backend does.
class SpinningExecutor final : public Executor {
 public:
  SpinningExecutor() { device_.name = "spin"; }
  const DeviceDescription& device() const override { return device_; }
  absl::StatusOr<StageTimes> Run(const AttentionParams& params) override {
    started_.Notify();
    while (!StopRequested(params.stop)) absl::SleepFor(absl::Milliseconds(1));
    return StoppedError();
  }
  Notification& started() { return started_; }

 private:
  DeviceDescription device_;
  Notification started_;
};

Scheduler MakeSpinningScheduler(SpinningExecutor** executor) {
  auto owned = std::make_unique<SpinningExecutor>();
  *executor = owned.get();
  std::vector<std::unique_ptr<Executor>> executors;
  executors.push_back(std::move(owned));
  return Scheduler(std::move(executors), {.workers = 1});
}

TEST(SchedulerStopTest, ARunningJobWhoseCallerCancelsIsStoppedAndSaysWhy) {
  SpinningExecutor* executor = nullptr;
  Scheduler scheduler = MakeSpinningScheduler(&executor);
  std::atomic<bool> cancelled{false};
  Outcome outcome;
  Job job = outcome.MakeJob();
  job.cancelled = [&cancelled] { return cancelled.load(); };
  scheduler.Submit(std::move(job));
  executor->started().WaitForNotification();
  const absl::Time cancel_time = absl::Now();
  cancelled = true;
  outcome.done.WaitForNotification();
  EXPECT_LT(absl::Now() - cancel_time, Scheduler::kStopPoll + absl::Seconds(1));
  EXPECT_EQ(outcome.result.status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(outcome.result.status.message(), HasSubstr("while running; the run was stopped"));
}

TEST(SchedulerStopTest, ARunningJobPastItsDeadlineIsStopped) {
  SpinningExecutor* executor = nullptr;
  Scheduler scheduler = MakeSpinningScheduler(&executor);
  Outcome outcome;
  Job job = outcome.MakeJob();
  job.deadline = absl::Now() + absl::Milliseconds(100);
  scheduler.Submit(std::move(job));
  outcome.done.WaitForNotification();
  EXPECT_EQ(outcome.result.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(outcome.result.status.message(), HasSubstr("deadline passed while running"));
}

TEST(SchedulerStopTest, AbortStopsWhatRunsAndAnswersWhatWaits) {
  SpinningExecutor* executor = nullptr;
  Scheduler scheduler = MakeSpinningScheduler(&executor);
  Outcome running, queued, later;
  scheduler.Submit(running.MakeJob());
  executor->started().WaitForNotification();
  scheduler.Submit(queued.MakeJob());
  scheduler.Abort(absl::UnavailableError("grace period over"));
  for (Outcome* o : {&running, &queued}) {
    o->done.WaitForNotification();
    EXPECT_EQ(o->result.status, absl::UnavailableError("grace period over"));
  }
  scheduler.Submit(later.MakeJob());
  ASSERT_TRUE(later.done.HasBeenNotified());
  EXPECT_EQ(later.result.status, absl::UnavailableError("grace period over"));
}

// With a spin far longer than the test, a job whose wake-up were lost (SubmitAll skips the
// notify while a worker spins) would wait out the spin, and Shutdown would too: both must not.
TEST(SchedulerTest, SpinningWorkersTakeEveryJobAndShutdownEndsTheSpin) {
  const absl::Time start = absl::Now();
  {
    Fixture f(1, {.workers = 2, .max_queue = 64, .worker_spin = absl::Seconds(60)});
    f.ReleaseAll();
    for (int round = 0; round < 20; ++round) {
      std::vector<Outcome> outcomes(round % 3 + 1);
      std::vector<std::thread> senders;
      for (Outcome& o : outcomes) {
        senders.emplace_back([&f, &o] { f.scheduler->Submit(o.MakeJob()); });
      }
      for (std::thread& t : senders) t.join();
      for (Outcome& o : outcomes) {
        o.done.WaitForNotification();
        EXPECT_TRUE(o.result.status.ok()) << o.result.status;
      }
      absl::SleepFor(absl::Microseconds(200 * (round % 4)));  // a worker spins meanwhile
    }
  }  // Shutdown
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

}  // namespace
}  // namespace attention::server
