// The device side of shared-memory regions (server/regions/): pinning a system region's mapping
// so its copies to and from the GPU run at the pinned rate with no staging copy, and opening a
// client's CUDA IPC handle (memory or event) on its device. Empty hooks for the cpu backend and
// builds without CUDA.
#pragma once

#include <string>

#include "server/regions/ipc_events.h"
#include "server/regions/region_registry.h"

namespace attention::server {

// Hooks for `backend` ("cpu" or "cuda"): with "cuda", pin_host is cudaHostRegister (portable:
// every GPU copies from it) and open_cuda cudaIpcOpenMemHandle on the region's device (the
// allocation's size from cuMemGetAddressRange, found through the runtime's driver entry point).
RegionHooks MakeRegionHooks(const std::string& backend);

// Event hooks for `backend`: with "cuda", cudaIpcOpenEventHandle on the event's device and
// cudaEventDestroy; else empty (events UNIMPLEMENTED).
EventHooks MakeEventHooks(const std::string& backend);

}  // namespace attention::server
