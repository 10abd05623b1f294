#include "kernels/cuda/ops/stream_counters.h"

#include <cuda.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"

namespace attention::cuda {
namespace {

using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

struct DriverOps {
  WaitValue64 wait = nullptr;
  WriteValue64 write = nullptr;
  absl::Status status;
};

// Looked up once (the driver's entry points do not change in a process's life).
const DriverOps& Ops() {
  static const DriverOps* ops = [] {
    auto* found = new DriverOps;
    for (const auto& [name, fn] :
         {std::pair{"cuStreamWaitValue64", reinterpret_cast<void**>(&found->wait)},
          std::pair{"cuStreamWriteValue64", reinterpret_cast<void**>(&found->write)}}) {
      cudaDriverEntryPointQueryResult result{};
      const cudaError_t err =
          cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &result);
      if (err != cudaSuccess || result != cudaDriverEntryPointSuccess || *fn == nullptr) {
        found->status = absl::UnimplementedError(
            absl::StrCat("cuda backend: the driver has no ", name, " (stream memory operations)"));
        break;
      }
    }
    return found;
  }();
  return *ops;
}

absl::Status DriverStatus(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuda backend: ", what, ": driver error ", result));
}

}  // namespace

absl::Status WaitCounter(cudaStream_t stream, const uint64_t* counter, uint64_t value) {
  const DriverOps& ops = Ops();
  if (!ops.status.ok()) return ops.status;
  return DriverStatus(
      ops.wait(stream, reinterpret_cast<CUdeviceptr>(counter), value, CU_STREAM_WAIT_VALUE_GEQ),
      "wait for the caller's ready_counter");
}

absl::Status WriteCounter(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  const DriverOps& ops = Ops();
  if (!ops.status.ok()) return ops.status;
  return DriverStatus(ops.write(stream, reinterpret_cast<CUdeviceptr>(counter), value,
                                CU_STREAM_WRITE_VALUE_DEFAULT),
                      "write the caller's done_counter");
}

}  // namespace attention::cuda
