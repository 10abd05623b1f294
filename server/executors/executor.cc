#include "server/executors/executor.h"

#include "kernels/status_macros.h"

namespace attention::server {

absl::StatusOr<KvPagePool*> Executor::InitKvPool(int64_t num_pages, int64_t page_bytes) {
  if (kv_pool_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(device().name, " already holds a KV pool of ",
                                                      kv_pool_->num_pages(), " pages"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<KvPagePool> pool, CreateKvPagePool(num_pages, page_bytes));
  kv_pool_ = std::move(pool);
  return kv_pool_.get();
}

absl::StatusOr<StageTimes> Executor::RunDecode(const PagedDecodeParams& host_params) {
  if (kv_pool_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(device().name, " keeps no KV pages: no decode step can run on it"));
  }
  ASSIGN_OR_RETURN(KvStepTimes times, kv_pool_->Decode(host_params));
  return StageTimes{.h2d_us = times.h2d_us, .compute_us = times.compute_us, .d2h_us = times.d2h_us};
}

}  // namespace attention::server
