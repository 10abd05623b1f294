// A GPU whose context a fault corrupts (a sticky CUDA error) leaves rotation: the executor's
// health check names the error, the scheduler stops sending it work and, with no device left,
// answers UNAVAILABLE at once; with two GPUs, the other keeps serving. Its own binary: the process
// cannot use the GPU afterwards. Skips, with a message, where no GPU is visible.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/executors/executor.h"
#include "server/scheduling/scheduler.h"
#include "server/testing/fault_kernel_for_tests.h"
#include "server/testing/notification_for_tests.h"
#include "server/testing/small_request_for_tests.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// Submits `params` and waits for its answer.
JobResult RunJob(Scheduler& scheduler, const AttentionParams& params) {
  Notification done;
  JobResult result;
  Job job;
  job.work = params;
  job.done = [&](JobResult r) {
    result = std::move(r);
    done.Notify();
  };
  scheduler.Submit(std::move(job));
  done.WaitForNotification();
  return result;
}

TEST(CudaDeviceLossTest, AStickyErrorTakesTheDeviceOutOfService) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped";
  }
  absl::StatusOr<std::unique_ptr<Executor>> made =
      MakeCudaExecutor(0, CudaExecutorOptions{.streams = 2});
  ASSERT_TRUE(made.ok()) << made.status();
  Executor* executor = made->get();
  std::vector<std::unique_ptr<Executor>> executors;
  executors.push_back(*std::move(made));
  int lost_calls = 0, in_service_after = -1;
  Scheduler scheduler(
      std::move(executors),
      {.workers = 1,
       .on_device_lost = [&](const DeviceDescription&, const absl::Status&, int in_service) {
         ++lost_calls;
         in_service_after = in_service;
       }});
  SmallRequest request;
  JobResult healthy = RunJob(scheduler, request.params);
  ASSERT_TRUE(healthy.status.ok()) << healthy.status;
  EXPECT_TRUE(executor->Health().ok());

  ASSERT_EQ(CorruptContextForTests(0), cudaErrorIllegalAddress);

  // The next request meets the error: INTERNAL for it, and the device leaves rotation.
  JobResult failed = RunJob(scheduler, request.params);
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kInternal);
  absl::Status health = executor->Health();
  EXPECT_EQ(health.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(health.message(), HasSubstr("cudaErrorIllegalAddress"));
  EXPECT_THAT(health.message(), HasSubstr("device lost"));
  EXPECT_EQ(scheduler.devices_in_service(), 0);
  EXPECT_EQ(lost_calls, 1);
  EXPECT_EQ(in_service_after, 0);
  EXPECT_FALSE(scheduler.device_loads().front().lost.ok());

  // No device left: refused at once, naming the device and the error.
  JobResult refused = RunJob(scheduler, request.params);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status.message(), HasSubstr("cuda:0"));
  EXPECT_EQ(refused.device, nullptr);
  EXPECT_EQ(lost_calls, 1);
}

// Two GPUs under load from several clients; a fault corrupts GPU 0's context mid-load. The jobs
// that fail are those GPU 0 ran, GPU 0 leaves rotation, and GPU 1 serves every job from then on.
// Run it alone (ctest does): it needs device 0's context intact at the start.
TEST(CudaDeviceLossTest, WithTwoDevicesTheOtherKeepsServing) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    GTEST_SKIP() << "fewer than two CUDA devices visible (" << count << "): GPU test skipped";
  }
  std::vector<std::unique_ptr<Executor>> executors;
  for (int ordinal : {0, 1}) {
    absl::StatusOr<std::unique_ptr<Executor>> made =
        MakeCudaExecutor(ordinal, CudaExecutorOptions{.streams = 2});
    ASSERT_TRUE(made.ok()) << made.status();
    executors.push_back(*std::move(made));
  }
  const std::string lost_name = executors[0]->device().name;
  const std::string kept_name = executors[1]->device().name;
  std::atomic<int> lost_calls{0};
  Scheduler scheduler(
      std::move(executors),
      {.workers = 4,
       .on_device_lost = [&](const DeviceDescription& device, const absl::Status&, int in_service) {
         ++lost_calls;
         EXPECT_EQ(device.name, lost_name);
         EXPECT_EQ(in_service, 1);
       }});
  // Each client sends jobs one after another until told to stop, counting its results by where
  // they ran; a failure anywhere but the lost device is recorded with its status.
  constexpr int kClients = 4;
  std::atomic<bool> corrupted{false}, stop{false};
  std::atomic<int> ok_before{0}, ok_after{0}, failed_on_lost{0}, after_on_kept{0};
  std::mutex mu;
  std::vector<std::string> bad;  // guarded by mu
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&] {
      SmallRequest request;
      while (!stop) {
        const bool after = corrupted;
        JobResult result = RunJob(scheduler, request.params);
        const std::string where = result.device != nullptr ? result.device->name : "none";
        if (result.status.ok()) {
          ++(after ? ok_after : ok_before);
          if (after && where == kept_name) ++after_on_kept;
        } else if (where == lost_name) {
          ++failed_on_lost;
        } else {
          std::lock_guard<std::mutex> lock(mu);
          bad.push_back(absl::StrCat(where, ": ", result.status.ToString()));
        }
      }
    });
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (ok_before < 200 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(CorruptContextForTests(0), cudaErrorIllegalAddress);
  corrupted = true;
  while ((scheduler.devices_in_service() > 1 || ok_after < 500) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  stop = true;
  for (std::thread& client : clients) client.join();
  std::printf("two devices: %d ok before the fault, %d ok after (%d on %s), %d failed on %s\n",
              ok_before.load(), ok_after.load(), after_on_kept.load(), kept_name.c_str(),
              failed_on_lost.load(), lost_name.c_str());
  EXPECT_THAT(bad, ::testing::IsEmpty()) << "failed requests beyond the lost device's";
  EXPECT_EQ(scheduler.devices_in_service(), 1);
  EXPECT_EQ(lost_calls, 1);
  EXPECT_GE(ok_after, 500);
  EXPECT_FALSE(scheduler.device_loads()[0].lost.ok());
  EXPECT_TRUE(scheduler.device_loads()[1].lost.ok());
  // A job from now on runs on the device left.
  SmallRequest request;
  JobResult last = RunJob(scheduler, request.params);
  ASSERT_TRUE(last.status.ok()) << last.status;
  EXPECT_EQ(last.device->name, kept_name);
}

}  // namespace
}  // namespace attention::server
