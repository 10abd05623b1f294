#include "kernels/cuda/runtime/wait_book.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace attention::cuda {

absl::Status WaitBook::Admit(Kind kind, const void* key) {
  const std::string bound =
      absl::StrCat("the server's ", absl::FormatDuration(timeout_), " (--stream_wait_timeout_s)");
  if (auto it = timed_out_.find({kind, key}); it != timed_out_.end()) {
    const uint64_t late = it->second;
    timed_out_.erase(it);
    return absl::FailedPreconditionError(
        kind == Kind::kCounter
            ? absl::StrCat("ready_counter: an earlier Step's wait for value ", late, " lasted ",
                           bound,
                           ", so the server wrote it itself: that Step read inputs that were not "
                           "ready and its o and lse are undefined")
            : absl::StrCat("ready_event: an earlier Step's wait for this event lasted ", bound,
                           ", so the server went on without it: that Step read inputs that were "
                           "not ready and its o and lse are undefined"));
  }
  if (kind == Kind::kEvent) {
    const int stuck = stuck_gates();
    if (stuck >= max_stuck_gates_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ready_event: expected fewer than ", max_stuck_gates_,
                       " waits for callers' events that outlasted ", bound,
                       " and have still not completed on this GPU, got ", stuck,
                       ": refused until one of those events completes"));
    }
  }
  return absl::OkStatus();
}

void WaitBook::Add(Kind kind, const void* key, uint64_t value, int slot, absl::Time now) {
  pending_.push_back({kind, key, value, slot, now + timeout_});
}

WaitBook::Sweep WaitBook::Look(absl::Time now, absl::FunctionRef<bool(const Wait&)> passed) {
  Sweep sweep;
  std::vector<Wait> still;
  for (Wait& w : pending_) {
    if (passed(w)) {
      sweep.passed.push_back(w);
      continue;
    }
    if (!w.late && now >= w.deadline) {
      w.late = true;
      timed_out_[{w.kind, w.key}] = w.value;
      sweep.late.push_back(w);
    }
    still.push_back(w);
  }
  pending_ = std::move(still);
  return sweep;
}

int WaitBook::stuck_gates() const {
  return static_cast<int>(std::count_if(pending_.begin(), pending_.end(), [](const Wait& w) {
    return w.kind == Kind::kEvent && w.late;
  }));
}

}  // namespace attention::cuda
