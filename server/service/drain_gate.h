// The server's one drain: every Attention and Sessions call passes this gate when it arrives, and
// leaves it once answered. On SIGTERM main closes the gate (new calls are answered UNAVAILABLE)
// and waits until every call that passed has been answered.
#pragma once

#include <condition_variable>
#include <mutex>

#include "absl/time/time.h"

namespace attention::server {

class DrainGate {
 public:
  // True when the call may proceed (it must then call Leave once answered); false once draining.
  // Checked and counted under one lock, so AwaitDrained never misses a call that passed just
  // before StartDraining.
  bool Enter() {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return false;
    ++inside_;
    return true;
  }
  void Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--inside_ == 0) drained_.notify_all();
  }

  void StartDraining() {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  // After StartDraining: blocks until every call that entered has left or `deadline` passes.
  // True when drained.
  bool AwaitDrained(absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return drained_.wait_until(lock, absl::ToChronoTime(deadline), [this] { return inside_ == 0; });
  }

 private:
  std::mutex mu_;  // a pthread lock, which ThreadSanitizer sees
  std::condition_variable drained_;
  bool draining_ = false;
  int inside_ = 0;
};

}  // namespace attention::server
