// A stream's waits for callers' ready counters (StepRequest.ready_counter), bounded. The server's
// stream serves every caller of its GPU, so a caller whose counter never reaches its value (a bug,
// a crash, or on purpose) would hold all of them: a watcher writes the value itself from a stream
// of its own once a wait has lasted `timeout`. The late caller's Step then ran on inputs that were
// not ready, so its next Step naming that counter is refused (FAILED_PRECONDITION, naming the
// value and the timeout) instead of letting undefined results pass unnoticed.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attention::cuda {

class CounterWaits {
 public:
  CounterWaits(int device, absl::Duration timeout) : device_(device), timeout_(timeout) {}
  // Writes every value still awaited (nothing stays blocked on a counter) and stops the watcher.
  ~CounterWaits();
  CounterWaits(const CounterWaits&) = delete;
  CounterWaits& operator=(const CounterWaits&) = delete;

  // Queues on `stream` the wait until *counter >= value (stream_counters.h), watched.
  absl::Status Wait(cudaStream_t stream, uint64_t* counter, uint64_t value);

 private:
  struct Pending {
    cudaEvent_t passed;  // recorded on the stream after the wait
    uint64_t* counter;
    uint64_t value;
    absl::Time deadline;
    bool written = false;  // by the watcher, past the deadline
  };
  void Watch();
  // Writes `p`'s value from the watcher's stream. Under mu_.
  void WriteLocked(Pending& p);

  const int device_;
  const absl::Duration timeout_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> idle_events_;
  // Counters the watcher wrote, with the value: their next Wait is refused once.
  std::map<const uint64_t*, uint64_t> timed_out_;
  cudaStream_t rescue_ = nullptr;
  bool stop_ = false;
  std::thread watcher_;  // started by the first Wait
};

}  // namespace attention::cuda
