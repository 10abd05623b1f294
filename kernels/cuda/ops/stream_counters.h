// Counters in device memory that order two streams of different processes (StepRequest's
// ready_counter and done_counter): a stream waits until a uint64 reaches a value, or writes one,
// through the driver's stream memory operations. Why not events: a caller can queue its wait for a
// value before the server has queued the write, so it need not wait for the server's answer first,
// and a wait that is never satisfied can be ended by writing the value from another stream.
// The driver's functions are found through the runtime (cudaGetDriverEntryPointByVersion), so the
// project links no libcuda.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace attention::cuda {

// Queues on `stream` a wait until *counter - value >= 0 as int64 (so values may wrap). `counter`:
// device memory, 8-aligned.
absl::Status WaitCounter(cudaStream_t stream, const uint64_t* counter, uint64_t value);

// Queues on `stream` the write of `value` into *counter, ordered after the stream's earlier work
// and visible to other streams and processes once done.
absl::Status WriteCounter(cudaStream_t stream, uint64_t* counter, uint64_t value);

}  // namespace attention::cuda
