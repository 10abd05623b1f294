// Builds without CUDA: system regions are not pinned, and CUDA regions and events are
// UNIMPLEMENTED.
#include "server/executors/region_hooks.h"

namespace attention::server {

RegionHooks MakeRegionHooks(const std::string& /*backend*/) { return RegionHooks{}; }

EventHooks MakeEventHooks(const std::string& /*backend*/) { return EventHooks{}; }

}  // namespace attention::server
