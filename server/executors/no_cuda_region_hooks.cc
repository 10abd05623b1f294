// Builds without CUDA: system regions are not pinned, and CUDA regions are UNIMPLEMENTED.
#include "server/executors/region_hooks.h"

namespace attention::server {

RegionHooks MakeRegionHooks(const std::string& /*backend*/) { return RegionHooks{}; }

}  // namespace attention::server
