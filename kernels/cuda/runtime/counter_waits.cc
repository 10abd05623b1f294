#include "kernels/cuda/runtime/counter_waits.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/stream_counters.h"
#include "kernels/status_macros.h"

namespace attention::cuda {
namespace {
constexpr absl::Duration kPoll = absl::Milliseconds(50);
using Kind = WaitBook::Kind;
}  // namespace

CounterWaits::~CounterWaits() {
  bool stuck = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cudaSetDevice(device_);
    for (const WaitBook::Wait& w : book_.pending()) {
      if (PassedLocked(w)) continue;
      if (!w.late) WriteLocked(w);
      stuck |= w.kind == Kind::kEvent;
    }
  }
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  if (rescue_ != nullptr) cudaStreamSynchronize(rescue_);
  for (cudaEvent_t e : passed_) cudaEventDestroy(e);
  // A gate still waiting for its event is released by the driver once that completes; its
  // counter may be written then, so the counters stay allocated.
  for (const Gate& g : gates_) {
    cudaEventDestroy(g.written);
    cudaStreamDestroy(g.stream);
  }
  if (!stuck) {
    for (uint64_t* block : gate_counters_) cudaFree(block);
  }
  if (rescue_ != nullptr) cudaStreamDestroy(rescue_);
}

absl::Status CounterWaits::Wait(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(book_.Admit(Kind::kCounter, counter));
  if (rescue_ == nullptr) {
    RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&rescue_, cudaStreamNonBlocking),
                         "create the counter watcher's stream");
  }
  int slot;
  if (!idle_passed_.empty()) {
    slot = idle_passed_.back();
    idle_passed_.pop_back();
  } else {
    cudaEvent_t passed;
    RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&passed, cudaEventDisableTiming),
                         "create a counter wait's event");
    slot = static_cast<int>(passed_.size());
    passed_.push_back(passed);
  }
  absl::Status status = WaitCounter(stream, counter, value);
  if (status.ok()) status = CudaStatus(cudaEventRecord(passed_[slot], stream), "cudaEventRecord");
  if (!status.ok()) {
    idle_passed_.push_back(slot);
    return status;
  }
  // The watcher sleeps until a wait is pending, then looks every kPoll while any is.
  const bool first = book_.pending().empty();
  book_.Add(Kind::kCounter, counter, value, slot, absl::Now());
  if (!watcher_.joinable()) watcher_ = std::thread([this] { Watch(); });
  if (first) wake_.notify_all();
  return absl::OkStatus();
}

absl::Status CounterWaits::WaitEvent(cudaStream_t stream, cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(book_.Admit(Kind::kEvent, event));
  // An event complete already needs no wait, so no gate: the common case in a decode loop, where
  // the caller's kernels before its record finished while its Step was on the way. (Its last
  // record is what a wait would wait for; the caller records again only for a later Step.)
  if (const cudaError_t query = cudaEventQuery(event); query != cudaErrorNotReady) {
    return CudaStatus(query, "query the caller's ready_event");
  }
  int g;
  RETURN_IF_ERROR(TakeGateLocked(&g));
  Gate& gate = gates_[g];
  const uint64_t value = gate.value + 1;
  // A failure past the first call leaves work queued on the gate: it is not taken again.
  absl::Status status =
      CudaStatus(cudaStreamWaitEvent(gate.stream, event, 0), "wait for the caller's ready_event");
  if (!status.ok()) {
    idle_gates_.push_back(g);
    return status;
  }
  RETURN_IF_ERROR(WriteCounter(gate.stream, gate.counter, value));
  RETURN_IF_CUDA_ERROR(cudaEventRecord(gate.written, gate.stream), "cudaEventRecord");
  gate.value = value;
  RETURN_IF_ERROR(WaitCounter(stream, gate.counter, value));
  const bool first = book_.pending().empty();
  book_.Add(Kind::kEvent, event, value, g, absl::Now());
  if (!watcher_.joinable()) watcher_ = std::thread([this] { Watch(); });
  if (first) wake_.notify_all();
  return absl::OkStatus();
}

absl::Status CounterWaits::TakeGateLocked(int* gate) {
  // A decode loop takes a gate per Step: those whose event completed since the watcher's last
  // look are free again.
  if (idle_gates_.empty()) SweepLocked();
  if (!idle_gates_.empty()) {
    *gate = idle_gates_.back();
    idle_gates_.pop_back();
    return absl::OkStatus();
  }
  if (gates_.size() >= kMaxGates) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ready_event: expected fewer than ", kMaxGates,
                     " waits for callers' events in flight on cuda:", device_, " at once, got ",
                     gates_.size(), ": refused until one of those events completes"));
  }
  if (rescue_ == nullptr) {
    RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&rescue_, cudaStreamNonBlocking),
                         "create the counter watcher's stream");
  }
  const size_t index = gates_.size() % kGatesPerBlock;
  if (index == 0) {
    // Zeroed on the watcher's stream, which holds only counter writes (it never waits), so the
    // synchronisation is short.
    void* block = nullptr;
    RETURN_IF_CUDA_ERROR(cudaMalloc(&block, kGatesPerBlock * sizeof(uint64_t)),
                         "allocate the event gates' counters");
    gate_counters_.push_back(static_cast<uint64_t*>(block));
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(block, 0, kGatesPerBlock * sizeof(uint64_t), rescue_),
                         "zero the event gates' counters");
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(rescue_), "zero the event gates' counters");
  }
  Gate g{.counter = gate_counters_.back() + index};
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking),
                       "create an event gate's stream");
  if (const cudaError_t err = cudaEventCreateWithFlags(&g.written, cudaEventDisableTiming);
      err != cudaSuccess) {
    cudaStreamDestroy(g.stream);
    return CudaStatus(err, "create an event gate's event");
  }
  *gate = static_cast<int>(gates_.size());
  gates_.push_back(g);
  return absl::OkStatus();
}

bool CounterWaits::PassedLocked(const WaitBook::Wait& w) {
  // An event's wait is over once its gate wrote: the stream's wait for the gate's counter then
  // holds, and a later value on the same gate keeps it holding.
  const cudaEvent_t e = w.kind == Kind::kCounter ? passed_[w.slot] : gates_[w.slot].written;
  return cudaEventQuery(e) == cudaSuccess;
}

void CounterWaits::SweepLocked() {
  const WaitBook::Sweep sweep =
      book_.Look(absl::Now(), [this](const WaitBook::Wait& w) { return PassedLocked(w); });
  for (const WaitBook::Wait& w : sweep.late) WriteLocked(w);
  bool drained = false;  // a stuck gate whose event completed
  for (const WaitBook::Wait& w : sweep.passed) {
    if (w.kind == Kind::kCounter) {
      idle_passed_.push_back(w.slot);
    } else {
      drained |= w.late;
      idle_gates_.push_back(w.slot);
    }
  }
  // The watcher's write of a drained gate's counter lands before the gate's next write, which it
  // would otherwise undo (the stream waiting for the next value would wait until the timeout).
  if (drained) cudaStreamSynchronize(rescue_);
}

void CounterWaits::WriteLocked(const WaitBook::Wait& w) {
  const bool counter = w.kind == Kind::kCounter;
  uint64_t* const target =
      counter ? static_cast<uint64_t*>(const_cast<void*>(w.key)) : gates_[w.slot].counter;
  const absl::Status status = WriteCounter(rescue_, target, w.value);
  const std::string what = counter ? absl::StrCat("a ready_counter stayed below ", w.value)
                                   : std::string("a ready_event did not complete");
  std::fprintf(stderr, "attention_server: cuda:%d: %s for %s; %s by the server%s%s\n", device_,
               what.c_str(), absl::FormatDuration(timeout_).c_str(), counter ? "written" : "passed",
               status.ok() ? "" : ": ", status.ok() ? "" : std::string(status.message()).c_str());
}

void CounterWaits::Watch() {
  cudaSetDevice(device_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (book_.pending().empty()) {
      wake_.wait(lock);
      continue;
    }
    SweepLocked();
    wake_.wait_for(lock, absl::ToChronoMilliseconds(kPoll));
  }
}

}  // namespace attention::cuda
