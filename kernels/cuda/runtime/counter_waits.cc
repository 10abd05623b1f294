#include "kernels/cuda/runtime/counter_waits.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/stream_counters.h"

namespace attention::cuda {
namespace {
constexpr absl::Duration kPoll = absl::Milliseconds(50);
}  // namespace

CounterWaits::~CounterWaits() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cudaSetDevice(device_);
    for (Pending& p : pending_) {
      if (!p.written && cudaEventQuery(p.passed) != cudaSuccess) WriteLocked(p);
    }
  }
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  if (rescue_ != nullptr) cudaStreamSynchronize(rescue_);
  for (const Pending& p : pending_) cudaEventDestroy(p.passed);
  for (cudaEvent_t e : idle_events_) cudaEventDestroy(e);
  if (rescue_ != nullptr) cudaStreamDestroy(rescue_);
}

absl::Status CounterWaits::Wait(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = timed_out_.find(counter); it != timed_out_.end()) {
    const uint64_t late = it->second;
    timed_out_.erase(it);
    return absl::FailedPreconditionError(absl::StrCat(
        "ready_counter: an earlier Step's wait for value ", late, " lasted the server's ",
        absl::FormatDuration(timeout_),
        " (--stream_wait_timeout_s), so the server wrote it itself: that Step read inputs that "
        "were not ready and its o and lse are undefined"));
  }
  if (rescue_ == nullptr) {
    RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&rescue_, cudaStreamNonBlocking),
                         "create the counter watcher's stream");
  }
  cudaEvent_t passed;
  if (!idle_events_.empty()) {
    passed = idle_events_.back();
    idle_events_.pop_back();
  } else {
    RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&passed, cudaEventDisableTiming),
                         "create a counter wait's event");
  }
  absl::Status status = WaitCounter(stream, counter, value);
  if (status.ok()) status = CudaStatus(cudaEventRecord(passed, stream), "cudaEventRecord");
  if (!status.ok()) {
    idle_events_.push_back(passed);
    return status;
  }
  // The watcher sleeps until a wait is pending, then looks every kPoll while any is.
  const bool first = pending_.empty();
  pending_.push_back({passed, counter, value, absl::Now() + timeout_});
  if (!watcher_.joinable()) watcher_ = std::thread([this] { Watch(); });
  if (first) wake_.notify_all();
  return absl::OkStatus();
}

void CounterWaits::WriteLocked(Pending& p) {
  p.written = true;
  const absl::Status status = WriteCounter(rescue_, p.counter, p.value);
  std::fprintf(stderr,
               "attention_server: cuda:%d: a ready_counter stayed below %llu for %s; written by "
               "the server%s%s\n",
               device_, static_cast<unsigned long long>(p.value),
               absl::FormatDuration(timeout_).c_str(), status.ok() ? "" : ": ",
               status.ok() ? "" : std::string(status.message()).c_str());
}

void CounterWaits::Watch() {
  cudaSetDevice(device_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (pending_.empty()) {
      wake_.wait(lock);
      continue;
    }
    const absl::Time now = absl::Now();
    std::vector<Pending> still;
    for (Pending& p : pending_) {
      if (cudaEventQuery(p.passed) == cudaSuccess) {
        idle_events_.push_back(p.passed);
        continue;
      }
      if (!p.written && now >= p.deadline) {
        WriteLocked(p);
        timed_out_[p.counter] = p.value;
      }
      still.push_back(p);
    }
    pending_ = std::move(still);
    wake_.wait_for(lock, absl::ToChronoMilliseconds(kPoll));
  }
}

}  // namespace attention::cuda
