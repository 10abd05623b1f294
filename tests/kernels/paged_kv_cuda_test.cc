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

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

// Stream order by counters (StepMemory::ready_counter, done_counter): a step queued before its
// ready counter is reached waits on the GPU (done stays unwritten), runs once the counter is
// written, and answers as the host path does, bit for bit; a ready counter never written is
// written by the pool after its stream_wait_timeout, and the next step naming it is refused
// FAILED_PRECONDITION; the step after that is served.
TEST(CudaKvPoolCountersTest, CountersOrderTheStepAndBoundTheWait) {
  if (!PoolUnavailableReason().empty()) GTEST_SKIP() << PoolUnavailableReason();
  constexpr int64_t kHeadDim = 64, kRows = 37;
  const KvShape shape{DType::kFloat32, 1, kHeadDim};
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool =
      cuda::MakeKvPagePool(0, 4, 64 * 2 * kHeadDim * 4, {.stream_wait_timeout = absl::Seconds(1)});
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::vector<float> k(kRows * kHeadDim), v(k.size()), q(kHeadDim);
  for (std::vector<float>* x : {&k, &v, &q}) {
    for (float& e : *x) e = normal(rng);
  }
  const int32_t table[] = {0};
  KvWrite w{.shape = shape,
            .page_table = table,
            .first_row = 0,
            .rows = kRows,
            .k = k.data(),
            .v = v.data(),
            .head_stride = kRows * kHeadDim,
            .row_stride = kHeadDim};
  ASSERT_EQ((*pool)->Write({w}), absl::OkStatus());
  const int32_t cu_q[] = {0, 1}, lens[] = {kRows};
  std::vector<float> host_o(kHeadDim);
  PagedDecodeParams p{.shape = shape,
                      .heads_q = 1,
                      .num_seqs = 1,
                      .q = q.data(),
                      .o = host_o.data(),
                      .cu_seqlens_q = cu_q,
                      .total_q = 1,
                      .max_seqlen_q = 1,
                      .seqlens_k = lens,
                      .max_seqlen_k = kRows,
                      .page_table = table,
                      .page_table_stride = 1,
                      .softmax_scale = 0.125f};
  ASSERT_TRUE((*pool)->Decode(p).ok());

  // q and o on the device, the counters too; a stream of the test's own reads and writes them
  // (the legacy stream would wait for the pool's).
  float *q_dev = nullptr, *o_dev = nullptr;
  uint64_t* counters = nullptr;  // [ready, done]
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&q_dev), kHeadDim * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&o_dev), kHeadDim * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&counters), 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(q_dev, q.data(), kHeadDim * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(counters, 0, 16), cudaSuccess);
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  auto read = [&](int i) {
    uint64_t value = ~uint64_t{0};
    EXPECT_EQ(cudaMemcpyAsync(&value, counters + i, 8, cudaMemcpyDeviceToHost, side), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(side), cudaSuccess);
    return value;
  };
  auto wait_for_done = [&](uint64_t value, absl::Duration within) {
    const absl::Time give_up = absl::Now() + within;
    while (read(1) != value && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    return read(1) == value;
  };
  auto step = [&](uint64_t ready, uint64_t done) {
    PagedDecodeParams d = p;
    d.q = q_dev;
    d.o = o_dev;
    d.memory = {.on_device = true,
                .ready_counter = counters,
                .ready_value = ready,
                .done_counter = counters + 1,
                .done_value = done};
    return (*pool)->Decode(d).status();
  };

  // Queued before its ready counter is reached: answered at once, done unwritten until then.
  ASSERT_EQ(step(1, 1), absl::OkStatus());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(read(1), 0u);
  const uint64_t one = 1;
  ASSERT_EQ(cudaMemcpyAsync(counters, &one, 8, cudaMemcpyHostToDevice, side), cudaSuccess);
  ASSERT_TRUE(wait_for_done(1, absl::Seconds(10)));
  std::vector<float> device_o(kHeadDim);
  ASSERT_EQ(cudaMemcpyAsync(device_o.data(), o_dev, kHeadDim * 4, cudaMemcpyDeviceToHost, side),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  EXPECT_EQ(device_o, host_o);

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

  cudaStreamDestroy(side);
  cudaDeviceSynchronize();
  cudaFree(q_dev);
  cudaFree(o_dev);
  cudaFree(counters);
}

}  // namespace

}  // namespace attention::kernel_test
