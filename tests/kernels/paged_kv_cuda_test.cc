// The paged KV pool tests on the CUDA backend's pool (GPU 0); they skip where no GPU is visible.
// ATTENTION_TEST_SPLITS=N runs every step with N splits instead of the planner's (at most one
// per key tile): the planner gives these small shapes as many splits as they have key tiles, the
// decode bench's shapes two; ATTENTION_TEST_CLUSTERS=0 merges splits through global memory even
// where the GPU has thread-block clusters. bench/cuda/decode_device_run.sh runs the suite as
// planned, with 2 and 3 splits, and with 2 splits without clusters.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/ops/stream_counters.h"
#include "kernels/cuda/runtime/paged_kv_pool.h"
#include "tests/kernels/paged_kv_pool_test.h"

namespace attention::kernel_test {

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeTestPool(int64_t num_pages, int64_t page_bytes) {
  const char* splits = std::getenv("ATTENTION_TEST_SPLITS");
  const char* clusters = std::getenv("ATTENTION_TEST_CLUSTERS");
  return cuda::MakeKvPagePool(
      /*device=*/0, num_pages, page_bytes,
      {.poison_outputs = true,
       .splits = splits != nullptr && *splits != '\0' ? std::atoi(splits) : 0,
       .clusters = clusters == nullptr || std::string(clusters) != "0"});
}

std::string PoolUnavailableReason() {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return "";
  return "no CUDA device visible: GPU test skipped";
}

PoolDeviceMemory TestPoolDeviceMemory() {
  // GPU 0, the pool's; failures abort (a test helper with no status to return).
  auto check = [](cudaError_t err) {
    if (err != cudaSuccess) {
      std::fprintf(stderr, "CUDA error in a test helper: %s\n", cudaGetErrorString(err));
      std::abort();
    }
  };
  auto new_event = [check] {
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return static_cast<void*>(event);
  };
  return {.upload =
              [check](const void* host, size_t bytes) {
                void* device = nullptr;
                check(cudaMalloc(&device, bytes));
                check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
                return device;
              },
          .download =
              [check](void* host, const void* device, size_t bytes) {
                check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
              },
          .free =
              [check](void* device) {
                check(cudaDeviceSynchronize());
                check(cudaFree(device));
              },
          .recorded_event =
              [check, new_event] {
                void* event = new_event();
                check(cudaEventRecord(static_cast<cudaEvent_t>(event), cudaStreamLegacy));
                return event;
              },
          .new_event = new_event,
          .synchronize =
              [check](void* event) {
                check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
                check(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
              }};
}

namespace {

// A pool with a 1 s stream_wait_timeout holding one sequence of kRows keys, the host path's
// answer to a step of one query over them, and q and two o buffers [2][kHeadDim] in the pool's
// device memory for the same step in stream order, with a stream of the test's own to read and
// write them (the legacy stream would wait for the pool's).
class CudaKvPoolStreamOrderTest : public ::testing::Test {
 protected:
  static constexpr int64_t kHeadDim = 64, kRows = 37;

  void SetUp() override {
    if (!PoolUnavailableReason().empty()) GTEST_SKIP() << PoolUnavailableReason();
    absl::StatusOr<std::unique_ptr<KvPagePool>> pool =
        cuda::MakeKvPagePool(0, 4, 64 * 2 * kHeadDim * 4,
                             {.poison_outputs = true, .stream_wait_timeout = absl::Seconds(1)});
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    std::mt19937_64 rng(std::random_device{}());
    std::normal_distribution<float> normal;
    k_.resize(kRows * kHeadDim);
    v_.resize(k_.size());
    q_.resize(kHeadDim);
    for (std::vector<float>* x : {&k_, &v_, &q_}) {
      for (float& e : *x) e = normal(rng);
    }
    const KvWrite w{.shape = shape_,
                    .page_table = table_,
                    .first_row = 0,
                    .rows = kRows,
                    .k = k_.data(),
                    .v = v_.data(),
                    .head_stride = kRows * kHeadDim,
                    .row_stride = kHeadDim};
    ASSERT_EQ(pool_->Write({w}), absl::OkStatus());
    host_o_.resize(kHeadDim);
    p_ = {.shape = shape_,
          .heads_q = 1,
          .num_seqs = 1,
          .q = q_.data(),
          .o = host_o_.data(),
          .cu_seqlens_q = cu_q_,
          .total_q = 1,
          .max_seqlen_q = 1,
          .seqlens_k = lens_,
          .max_seqlen_k = kRows,
          .page_table = table_,
          .page_table_stride = 1,
          .softmax_scale = 0.125f};
    ASSERT_TRUE(pool_->Decode(p_).ok());
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&q_dev_), kHeadDim * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&o_dev_), 2 * kHeadDim * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q_dev_, q_.data(), kHeadDim * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (pool_ == nullptr) return;
    if (side_ != nullptr) cudaStreamDestroy(side_);
    cudaDeviceSynchronize();
    cudaFree(q_dev_);
    cudaFree(o_dev_);
  }

  // The step on the device in stream order by `memory`, writing o buffer `out`.
  absl::Status Step(StepMemory memory, int out = 0) {
    PagedDecodeParams d = p_;
    d.q = q_dev_;
    d.o = o_dev_ + out * kHeadDim;
    memory.on_device = true;
    d.memory = memory;
    return pool_->Decode(d).status();
  }
  // o buffer `out` as the device's steps left it.
  std::vector<float> DeviceO(int out = 0) {
    std::vector<float> o(kHeadDim);
    EXPECT_EQ(cudaMemcpyAsync(o.data(), o_dev_ + out * kHeadDim, kHeadDim * 4,
                              cudaMemcpyDeviceToHost, side_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
    return o;
  }

  const KvShape shape_{DType::kFloat32, 1, kHeadDim};
  const int32_t table_[1] = {0}, cu_q_[2] = {0, 1}, lens_[1] = {kRows};
  std::vector<float> q_, k_, v_, host_o_;
  PagedDecodeParams p_;
  std::unique_ptr<KvPagePool> pool_;
  float *q_dev_ = nullptr, *o_dev_ = nullptr;
  cudaStream_t side_ = nullptr;
};

// Stream order by counters (StepMemory::ready_counter, done_counter): a step queued before its
// ready counter is reached waits on the GPU (done stays unwritten), runs once the counter is
// written, and answers as the host path does, bit for bit; a ready counter never written is
// written by the pool after its stream_wait_timeout, and the next step naming it is refused
// FAILED_PRECONDITION; the step after that is served.
TEST_F(CudaKvPoolStreamOrderTest, CountersOrderTheStepAndBoundTheWait) {
  uint64_t* counters = nullptr;  // [ready, done]
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&counters), 16), cudaSuccess);
  ASSERT_EQ(cudaMemset(counters, 0, 16), cudaSuccess);
  auto read = [&](int i) {
    uint64_t value = ~uint64_t{0};
    EXPECT_EQ(cudaMemcpyAsync(&value, counters + i, 8, cudaMemcpyDeviceToHost, side_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
    return value;
  };
  auto wait_for_done = [&](uint64_t value, absl::Duration within) {
    const absl::Time give_up = absl::Now() + within;
    while (read(1) != value && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    return read(1) == value;
  };
  auto step = [&](uint64_t ready, uint64_t done) {
    return Step({.ready_counter = counters,
                 .ready_value = ready,
                 .done_counter = counters + 1,
                 .done_value = done});
  };

  // Queued before its ready counter is reached: answered at once, done unwritten until then.
  ASSERT_EQ(step(1, 1), absl::OkStatus());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(read(1), 0u);
  const uint64_t one = 1;
  ASSERT_EQ(cudaMemcpyAsync(counters, &one, 8, cudaMemcpyHostToDevice, side_), cudaSuccess);
  ASSERT_TRUE(wait_for_done(1, absl::Seconds(10)));
  EXPECT_EQ(DeviceO(), host_o_);

  // A ready counter never written: the pool writes it after its timeout (1 s).
  const absl::Time start = absl::Now();
  ASSERT_EQ(step(5, 2), absl::OkStatus());
  ASSERT_TRUE(wait_for_done(2, absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  EXPECT_EQ(read(0), 5u);
  const absl::Status refused = step(6, 3);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("ready_counter"));
  // Then served (its ready value reached already).
  ASSERT_EQ(step(5, 4), absl::OkStatus());
  EXPECT_TRUE(wait_for_done(4, absl::Seconds(10)));
  cudaDeviceSynchronize();
  cudaFree(counters);
}

// Stream order by the caller's events (StepMemory::ready, done) that complete in time, through
// the pool's gates (a gate stream waits for the event and writes the counter the pool's stream
// waits on): q written by the caller's stream just before its ready event is read by the step,
// and done completes once o is written, bit for bit the host path's; every step's o buffer was
// poisoned by the caller first. Steps one after another reuse the gates. (No stream is held here,
// so compute-sanitizer, which serialises launches, runs this one; the late event's test below
// holds a stream on purpose.)
TEST_F(CudaKvPoolStreamOrderTest, ReadyEventsOrderTheStep) {
  cudaEvent_t ready, done;
  for (cudaEvent_t* e : {&ready, &done}) {
    ASSERT_EQ(cudaEventCreateWithFlags(e, cudaEventDisableTiming), cudaSuccess);
  }
  for (int i = 0; i < 4; ++i) {
    const int out = i % 2;
    ASSERT_EQ(cudaMemsetAsync(q_dev_, 0xff, kHeadDim * 4, side_), cudaSuccess);  // NaN
    ASSERT_EQ(cudaMemsetAsync(o_dev_ + out * kHeadDim, 0xff, kHeadDim * 4, side_), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(q_dev_, q_.data(), kHeadDim * 4, cudaMemcpyHostToDevice, side_),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ready, side_), cudaSuccess);
    ASSERT_EQ(Step({.ready = ready, .done = done}, out), absl::OkStatus());
    ASSERT_EQ(cudaEventSynchronize(done), cudaSuccess);
    EXPECT_EQ(DeviceO(out), host_o_) << "step " << i;
  }
  for (cudaEvent_t e : {ready, done}) cudaEventDestroy(e);
}

// Stream order by the caller's events (StepMemory::ready, done), bounded as counters are. A step
// whose ready event is recorded behind a counter wait the test holds (it completes only when the
// test says) still runs once the pool's stream_wait_timeout passed, and a step queued behind it
// whose event completed at once runs then too, answering as the host path does; the next step
// naming the late event is refused FAILED_PRECONDITION while steps with other events are served
// at once (the late event's gate is stuck, the pool's stream is not); once the late event
// completed, steps naming it are served again.
TEST_F(CudaKvPoolStreamOrderTest, ReadyEventsAreBoundedByTheTimeout) {
  uint64_t* hold = nullptr;  // the held stream waits until it is 1
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&hold), 8), cudaSuccess);
  ASSERT_EQ(cudaMemset(hold, 0, 8), cudaSuccess);
  cudaStream_t held = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t late, late_done, ready, done;
  for (cudaEvent_t* e : {&late, &late_done, &ready, &done}) {
    ASSERT_EQ(cudaEventCreateWithFlags(e, cudaEventDisableTiming), cudaSuccess);
  }
  ASSERT_EQ(cuda::WaitCounter(held, hold, 1), absl::OkStatus());
  ASSERT_EQ(cudaEventRecord(late, held), cudaSuccess);
  // Whatever fails below, the held stream is released (the fixture's synchronisation would hang).
  bool released = false;
  auto release = [&] {
    if (released) return;
    released = true;
    const uint64_t one = 1;
    EXPECT_EQ(cudaMemcpyAsync(hold, &one, 8, cudaMemcpyHostToDevice, side_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(side_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(held), cudaSuccess);
  };
  absl::Cleanup release_at_exit = release;
  auto completes = [](cudaEvent_t e, absl::Duration within) {
    const absl::Time give_up = absl::Now() + within;
    while (cudaEventQuery(e) == cudaErrorNotReady && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return cudaEventQuery(e) == cudaSuccess;
  };

  ASSERT_EQ(cudaEventRecord(ready, side_), cudaSuccess);
  const absl::Time start = absl::Now();
  ASSERT_EQ(Step({.ready = late, .done = late_done}, 0), absl::OkStatus());
  ASSERT_EQ(Step({.ready = ready, .done = done}, 1), absl::OkStatus());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));  // answered once queued
  EXPECT_EQ(cudaEventQuery(done), cudaErrorNotReady);       // behind the late step
  ASSERT_TRUE(completes(late_done, absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  ASSERT_TRUE(completes(done, absl::Seconds(10)));
  EXPECT_EQ(cudaEventQuery(late), cudaErrorNotReady);  // the pool went on without it
  // q was on the device all along: the late step's result is right here, as the other's.
  EXPECT_EQ(DeviceO(0), host_o_);
  EXPECT_EQ(DeviceO(1), host_o_);

  const absl::Status refused = Step({.ready = late, .done = late_done});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("ready_event"));
  // Another event's step, while the late event's gate still waits for it: served at once.
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(cudaEventRecord(ready, side_), cudaSuccess);
    const absl::Time queued = absl::Now();
    ASSERT_EQ(Step({.ready = ready, .done = done}, 1), absl::OkStatus());
    ASSERT_TRUE(completes(done, absl::Seconds(10)));
    EXPECT_LT(absl::Now() - queued, absl::Milliseconds(500));
    EXPECT_EQ(DeviceO(1), host_o_);
  }

  // The late event completes: steps naming it are served again.
  release();
  ASSERT_EQ(Step({.ready = late, .done = late_done}, 0), absl::OkStatus());
  ASSERT_TRUE(completes(late_done, absl::Seconds(10)));
  EXPECT_EQ(DeviceO(0), host_o_);

  for (cudaEvent_t e : {late, late_done, ready, done}) cudaEventDestroy(e);
  cudaStreamDestroy(held);
  cudaFree(hold);
}

}  // namespace

}  // namespace attention::kernel_test
