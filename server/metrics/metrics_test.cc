#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/scheduling/scheduler.h"
#include "server/testing/notification_for_tests.h"
#include "server/testing/run_gate_for_tests.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, ExportsTheContractNamesAndLabels) {
  Metrics metrics(BuildInfo{.version = "1.2.3", .backend = "cpu", .cuda = "none"});
  metrics.RequestStarted();
  metrics.RequestStarted();
  metrics.RequestFinished("Attend", absl::StatusCode::kOk, absl::Milliseconds(3), 4096, 2048);
  metrics.RequestFinished("Attend", absl::StatusCode::kInvalidArgument, absl::Microseconds(50), 100,
                          0);
  metrics.StagesObserved(absl::Microseconds(10), StageTimes{.compute_us = 2500});
  metrics.Computed("cpu", 1e9, 128);
  metrics.SetQueueDepth(3);
  metrics.SetDeviceMemoryTotal("cpu", 1 << 30);
  metrics.SetKvHostTier("cpu", 8192, 65536);
  metrics.KvHostTierMoved("cpu", 3, 0, 0);
  metrics.KvHostTierMoved("cpu", 0, 2, 50e-6);

  const std::string text = metrics.Scrape();
  EXPECT_THAT(text, HasSubstr("attention_kv_host_bytes_used{device=\"cpu\"} 8192"));
  EXPECT_THAT(text, HasSubstr("attention_kv_host_bytes_capacity{device=\"cpu\"} 65536"));
  EXPECT_THAT(text,
              HasSubstr("attention_kv_host_pages_total{device=\"cpu\",direction=\"spilled\"} 3"));
  EXPECT_THAT(text,
              HasSubstr("attention_kv_host_pages_total{device=\"cpu\",direction=\"restored\"} 2"));
  EXPECT_THAT(text,
              HasSubstr("attention_kv_host_restore_duration_seconds_count{device=\"cpu\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_requests_total{code=\"OK\",rpc=\"Attend\"} 1"));
  EXPECT_THAT(text,
              HasSubstr("attention_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"Attend\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_request_duration_seconds_count{rpc=\"Attend\"} 2"));
  // Buckets from 20 us, doubling: the 50 us request lands above le=4e-05.
  EXPECT_THAT(
      text, HasSubstr("attention_request_duration_seconds_bucket{rpc=\"Attend\",le=\"2e-05\"} 0"));
  EXPECT_THAT(
      text, HasSubstr("attention_request_duration_seconds_bucket{rpc=\"Attend\",le=\"4e-05\"} 0"));
  EXPECT_THAT(
      text,
      HasSubstr("attention_request_duration_seconds_bucket{rpc=\"Attend\",le=\"0.00016\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_stage_duration_seconds_count{stage=\"compute\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_stage_duration_seconds_count{stage=\"queue\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_request_bytes_count{rpc=\"Attend\"} 2"));
  EXPECT_THAT(text, HasSubstr("attention_response_bytes_sum{rpc=\"Attend\"} 2048"));
  EXPECT_THAT(text, HasSubstr("attention_batch_size_count{device=\"cpu\"} 1"));
  EXPECT_THAT(text, HasSubstr("attention_inflight_requests 0"));
  EXPECT_THAT(text, HasSubstr("attention_queue_depth 3"));
  EXPECT_THAT(text, HasSubstr("attention_flops_total{device=\"cpu\"} 1000000000"));
  EXPECT_THAT(text, HasSubstr("attention_tokens_total{device=\"cpu\"} 128"));
  EXPECT_THAT(text, HasSubstr("attention_device_memory_total_bytes{device=\"cpu\"} 1073741824"));
  EXPECT_THAT(text,
              HasSubstr("attention_build_info{backend=\"cpu\",cuda=\"none\",version=\"1.2.3\"} 1"));
  EXPECT_THAT(text, HasSubstr("# TYPE attention_request_duration_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("# TYPE attention_requests_total counter"));
  EXPECT_THAT(text, Not(HasSubstr("request_id")));
}

// GET /metrics over a plain socket; the whole reply (headers and body).
std::string HttpGet(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) reply.append(buffer, n);
    }
  }
  close(fd);
  return reply;
}

TEST(MetricsTest, ServesOverHttpOnAFreePort) {
  Metrics metrics(BuildInfo{.version = "1.2.3", .backend = "cpu", .cuda = "none"});
  absl::StatusOr<int> port = metrics.Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_GT(*port, 0);
  const std::string reply = HttpGet(*port);
  EXPECT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, HasSubstr("attention_build_info{"));
}

TEST(MetricsTest, ReportsAPortInUse) {
  Metrics first(BuildInfo{});
  absl::StatusOr<int> port = first.Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  Metrics second(BuildInfo{});
  absl::StatusOr<int> clash = second.Serve("127.0.0.1:" + std::to_string(*port));
  EXPECT_FALSE(clash.ok());
  EXPECT_THAT(clash.status().message(), HasSubstr("cannot listen on 127.0.0.1:"));
}

// An executor whose runs take `run_time` and which reports `memory` (or nothing when absent);
// with a `gate`, each run first waits for it to open.
class SleepingExecutor final : public Executor {
 public:
  SleepingExecutor(std::string name, absl::Duration run_time, std::optional<MemoryUsage> memory,
                   RunGate* gate = nullptr)
      : run_time_(run_time), memory_(memory), gate_(gate) {
    device_.name = std::move(name);
  }
  const DeviceDescription& device() const override { return device_; }
  absl::StatusOr<MemoryUsage> Memory() const override {
    if (!memory_.has_value()) return Executor::Memory();
    return *memory_;
  }
  absl::StatusOr<StageTimes> Run(const AttentionParams&) override {
    if (gate_ != nullptr) gate_->Pass();
    absl::SleepFor(run_time_);
    return StageTimes{.compute_us = absl::ToDoubleMicroseconds(run_time_)};
  }

 private:
  DeviceDescription device_;
  const absl::Duration run_time_;
  const std::optional<MemoryUsage> memory_;
  RunGate* const gate_;
};

// Runs one job on `scheduler` and waits for it.
void RunOneJob(Scheduler& scheduler) {
  Notification done;
  Job job;
  job.done = [&done](JobResult) { done.Notify(); };
  scheduler.Submit(std::move(job));
  done.WaitForNotification();
}

// The value of the sample line `series` ("name{labels}"); nullopt when absent.
std::optional<double> SampleValue(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
}

// The conventional process metrics, read at each scrape.
TEST(MetricsTest, ExportsProcessMetrics) {
  Metrics metrics(BuildInfo{});
  const std::string before = metrics.Scrape();
  for (const char* name : {"process_cpu_seconds_total", "process_resident_memory_bytes",
                           "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
                           "process_start_time_seconds"}) {
    EXPECT_TRUE(SampleValue(before, name).has_value()) << name << " missing from:\n" << before;
  }
  EXPECT_THAT(before, HasSubstr("# TYPE process_cpu_seconds_total counter"));
  EXPECT_THAT(before, HasSubstr("# TYPE process_open_fds gauge"));
  const double resident = SampleValue(before, "process_resident_memory_bytes").value_or(0);
  EXPECT_GT(resident, 1 << 20);
  EXPECT_GE(SampleValue(before, "process_virtual_memory_bytes").value_or(0), resident);
  const double open_fds = SampleValue(before, "process_open_fds").value_or(0);
  EXPECT_GE(open_fds, 3);  // stdin, stdout, stderr at least
  EXPECT_GE(SampleValue(before, "process_max_fds").value_or(0), open_fds);
  // This test's process started less than ten minutes ago.
  const double start = SampleValue(before, "process_start_time_seconds").value_or(0);
  const double now = absl::ToUnixMicros(absl::Now()) * 1e-6;
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 600);

  // Each scrape reads them anew: two more descriptors, and CPU time spent.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const double cpu_before = SampleValue(before, "process_cpu_seconds_total").value_or(0);
  for (const absl::Time end = absl::Now() + absl::Milliseconds(50); absl::Now() < end;) {
  }
  const std::string after = metrics.Scrape();
  EXPECT_EQ(SampleValue(after, "process_open_fds"), open_fds + 2);
  EXPECT_GT(SampleValue(after, "process_cpu_seconds_total").value_or(0), cpu_before);
  close(fds[0]);
  close(fds[1]);
}

TEST(MetricsTest, WatchExportsDeviceMemoryAndQueueCapacity) {
  Metrics metrics(BuildInfo{});
  std::vector<std::unique_ptr<Executor>> executors;
  executors.push_back(std::make_unique<SleepingExecutor>(
      "dev0", absl::ZeroDuration(), MemoryUsage{.used_bytes = 123456, .total_bytes = 789012}));
  executors.push_back(
      std::make_unique<SleepingExecutor>("dev1", absl::ZeroDuration(), std::nullopt));
  Scheduler scheduler(std::move(executors), SchedulerOptions{.workers = 1, .max_queue = 7});
  {
    const auto watch = metrics.Watch(scheduler);
    const std::string text = metrics.Scrape();
    EXPECT_THAT(text, HasSubstr("attention_device_memory_used_bytes{device=\"dev0\"} 123456"));
    EXPECT_THAT(text, HasSubstr("attention_device_memory_total_bytes{device=\"dev0\"} 789012"));
    // dev1 cannot tell its memory: no sample rather than a made-up one.
    EXPECT_THAT(text, Not(HasSubstr("attention_device_memory_used_bytes{device=\"dev1\"}")));
    EXPECT_THAT(text, HasSubstr("attention_device_busy_ratio{device=\"dev0\"} 0"));
    EXPECT_THAT(text, HasSubstr("attention_device_busy_ratio{device=\"dev1\"} 0"));
    EXPECT_THAT(text, HasSubstr("attention_queue_capacity 7"));
    EXPECT_THAT(text, HasSubstr("# TYPE attention_device_busy_ratio gauge"));
  }
  // Unwatched: scrapes no longer sample the scheduler (which may now go), and still work.
  EXPECT_THAT(metrics.Scrape(), HasSubstr("attention_queue_capacity 7"));
}

TEST(MetricsTest, BusyRatioCoversTheRecentWindow) {
  constexpr absl::Duration kRun = absl::Milliseconds(300);
  constexpr absl::Duration kIdle = absl::Milliseconds(300);
  Metrics metrics(BuildInfo{});
  std::vector<std::unique_ptr<Executor>> executors;
  executors.push_back(std::make_unique<SleepingExecutor>("dev0", kRun, std::nullopt));
  Scheduler scheduler(std::move(executors), SchedulerOptions{.workers = 1});
  const std::string series = "attention_device_busy_ratio{device=\"dev0\"}";
  const auto watch = metrics.Watch(scheduler, /*busy_window=*/absl::Milliseconds(100));

  // Scrape A, one run of kRun, kIdle of nothing, scrape B: the window A..B is busy for the run.
  const absl::Time a0 = absl::Now();
  EXPECT_EQ(SampleValue(metrics.Scrape(), series), 0.0);
  RunOneJob(scheduler);
  absl::SleepFor(kIdle);
  const std::optional<double> ratio = SampleValue(metrics.Scrape(), series);
  const absl::Duration ab_max = absl::Now() - a0;
  ASSERT_TRUE(ratio.has_value());
  // Busy at least kRun and idle at least kIdle within A..B, which is at most ab_max long.
  EXPECT_GE(*ratio, absl::FDivDuration(kRun, ab_max));
  EXPECT_LE(*ratio, absl::FDivDuration(ab_max - kIdle, ab_max));

  // Scrape C more than a window after B: the window B..C saw no run, whatever came before.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(SampleValue(metrics.Scrape(), series), 0.0);
}

// attention_device_running_batches counts the batches a device runs now: two workers' runs held
// at the gate on one device read 2, and 0 once they are done.
TEST(MetricsTest, RunningBatchesCountWhatTheDeviceRunsNow) {
  Metrics metrics(BuildInfo{});
  RunGate gate;
  std::vector<std::unique_ptr<Executor>> executors;
  executors.push_back(
      std::make_unique<SleepingExecutor>("dev0", absl::ZeroDuration(), std::nullopt, &gate));
  Scheduler scheduler(std::move(executors), SchedulerOptions{.workers = 2});
  const std::string series = "attention_device_running_batches{device=\"dev0\"}";
  const auto watch = metrics.Watch(scheduler);
  EXPECT_EQ(SampleValue(metrics.Scrape(), series), 0.0);

  Notification done[2];
  for (Notification& n : done) {
    Job job;
    job.done = [&n](JobResult) { n.Notify(); };
    scheduler.Submit(std::move(job));
  }
  gate.AwaitStarted(2);
  EXPECT_EQ(SampleValue(metrics.Scrape(), series), 2.0);
  gate.Open();
  for (Notification& n : done) n.WaitForNotification();
  EXPECT_EQ(SampleValue(metrics.Scrape(), series), 0.0);
}

}  // namespace
}  // namespace attention::server
