#include <cuda.h>  // CUdeviceptr and CUresult for cuMemGetAddressRange's type; no libcuda linked
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "server/executors/region_hooks.h"

namespace attention::server {
namespace {

using MemGetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

absl::StatusOr<std::pair<void*, int64_t>> OpenIpcHandle(absl::string_view handle, int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected a GPU ordinal 0..", count - 1, ", got ", device));
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return cuda::CudaError(err, "cudaSetDevice");
  }
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == 64, "the registry checks 64-byte handles");
  std::memcpy(&h, handle.data(), sizeof(h));
  void* base = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc_handle: cudaIpcOpenMemHandle on cuda:", device,
                     " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
  }
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  size_t size = 0;
  CUdeviceptr alloc_base = 0;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess ||
      reinterpret_cast<MemGetAddressRange>(fn)(
          &alloc_base, &size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
    cudaGetLastError();
    cudaIpcCloseMemHandle(base);
    return absl::InternalError("cuda_ipc_handle: the opened allocation's size is unknown");
  }
  // The handle names its allocation's start; what follows `base` is the allocation's rest.
  const int64_t bytes = static_cast<int64_t>(size) -
                        static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(base) - alloc_base);
  return std::pair<void*, int64_t>{base, bytes};
}

absl::StatusOr<void*> OpenIpcEvent(absl::string_view handle, int device) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cuda:", device, " cannot be used: ", cudaGetErrorName(err)));
  }
  cudaIpcEventHandle_t h;
  static_assert(sizeof(h) == 64, "IpcEvents checks 64-byte handles");
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t event = nullptr;
  if (cudaError_t err = cudaIpcOpenEventHandle(&event, h); err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cudaIpcOpenEventHandle on cuda:", device, " failed: ", cudaGetErrorName(err),
                     " (", cudaGetErrorString(err),
                     "; the event must be made with cudaEventInterprocess | "
                     "cudaEventDisableTiming)"));
  }
  return static_cast<void*>(event);
}

}  // namespace

EventHooks MakeEventHooks(const std::string& backend) {
  EventHooks hooks;
  if (backend != "cuda") return hooks;
  hooks.open = OpenIpcEvent;
  hooks.close = [](void* event, int device) {
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) {
      cudaGetLastError();
    }
  };
  return hooks;
}

RegionHooks MakeRegionHooks(const std::string& backend) {
  RegionHooks hooks;
  if (backend != "cuda") return hooks;
  hooks.pin_host = [](void* data, int64_t bytes) {
    const bool pinned =
        cudaHostRegister(data, static_cast<size_t>(bytes), cudaHostRegisterPortable) == cudaSuccess;
    if (!pinned) cudaGetLastError();  // not pinned: copies go through staging instead
    return pinned;
  };
  hooks.unpin_host = [](void* data) {
    if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  };
  hooks.open_cuda = OpenIpcHandle;
  hooks.close_cuda = [](void* base, int device) {
    // A Step in stream order answers before its kernels ran: they may still read or write the
    // region when its client unregisters it, so the device's queued work finishes first.
    if (cudaSetDevice(device) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
        cudaIpcCloseMemHandle(base) != cudaSuccess) {
      cudaGetLastError();
    }
  };
  return hooks;
}

}  // namespace attention::server
