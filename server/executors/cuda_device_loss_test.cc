// A GPU whose context a fault corrupts (a sticky CUDA error) leaves rotation: the executor's
// health check names the error, the scheduler stops sending it work and, with no device left,
// answers UNAVAILABLE at once. Its own binary: the process cannot use the GPU afterwards. Skips,
// with a message, where no GPU is visible.
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

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

}  // namespace
}  // namespace attention::server
