// A stream's waits for its callers' inputs (StepRequest.ready_counter, ready_event), bounded. The
// server's stream serves every caller of its GPU, so a caller whose counter never reaches its
// value or whose event never completes (a bug, a crash, or on purpose) would hold all of them: a
// watcher writes the value itself from a stream of its own once a wait has lasted `timeout`. The
// late caller's Step then ran on inputs that were not ready, so its next Step naming that counter
// or event is refused (FAILED_PRECONDITION, naming the field and the timeout) instead of letting
// undefined results pass unnoticed.
//
// A stream waiting for an event (cudaStreamWaitEvent) cannot be released, so the stream never
// waits for a caller's event itself: a gate (a stream and a counter of the watcher's) waits for
// the event and then writes its counter, and the stream waits for that counter, on the GPU both
// (no host polling on the way). A gate past the timeout has its counter written by the watcher
// and is stuck until the event completes: no later wait queues behind it, and at most
// kMaxStuckGates are stuck at once (more ready_event waits are refused RESOURCE_EXHAUSTED).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/cuda/runtime/wait_book.h"

namespace attention::cuda {

class CounterWaits {
 public:
  // Gates waiting for events that outlasted the timeout, at most; and gates in all (a gate is busy
  // from its wait's queuing until its event completes).
  static constexpr int kMaxStuckGates = 8;
  static constexpr int kMaxGates = 256;

  CounterWaits(int device, absl::Duration timeout)
      : device_(device), timeout_(timeout), book_(timeout, kMaxStuckGates) {}
  // Writes every value still awaited (nothing stays blocked on a counter or a gate) and stops the
  // watcher.
  ~CounterWaits();
  CounterWaits(const CounterWaits&) = delete;
  CounterWaits& operator=(const CounterWaits&) = delete;

  // Queues on `stream` the wait until *counter >= value (stream_counters.h), watched.
  absl::Status Wait(cudaStream_t stream, uint64_t* counter, uint64_t value);
  // Queues on `stream` the wait for the caller's `event` (its last record), through a gate,
  // watched; nothing when the event completed already.
  absl::Status WaitEvent(cudaStream_t stream, cudaEvent_t event);

 private:
  struct Gate {
    cudaStream_t stream;
    uint64_t* counter;    // device memory, in one of gate_counters_
    uint64_t value = 0;   // the last written (counters start at 0)
    cudaEvent_t written;  // recorded on the gate's stream after its write
  };
  static constexpr int kGatesPerBlock = 64;  // counters per cudaMalloc

  void Watch();
  // Takes an idle gate (after a sweep, or a new one). Under mu_.
  absl::Status TakeGateLocked(int* gate);
  // The watcher's look at the waits: writes those past their deadline, frees the slots and gates
  // of those passed. Under mu_.
  void SweepLocked();
  bool PassedLocked(const WaitBook::Wait& w);
  // Writes `w`'s value (to the caller's counter or to its gate's) from the watcher's stream. Under
  // mu_.
  void WriteLocked(const WaitBook::Wait& w);

  const int device_;
  const absl::Duration timeout_;
  std::mutex mu_;
  std::condition_variable wake_;
  WaitBook book_;
  // Recorded on a stream after a counter's wait (a WaitBook::Wait's slot), and those free.
  std::vector<cudaEvent_t> passed_;
  std::vector<int> idle_passed_;
  std::vector<Gate> gates_;  // a WaitBook::Wait's slot of an event
  std::vector<int> idle_gates_;
  std::vector<uint64_t*> gate_counters_;  // kGatesPerBlock uint64s each
  cudaStream_t rescue_ = nullptr;
  bool stop_ = false;
  std::thread watcher_;  // started by the first wait
};

}  // namespace attention::cuda
