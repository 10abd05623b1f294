// Tests only: a gate that holds executor runs until the test opens it, and lets the test wait until
// a number of runs have reached it. Shared by the scheduler and service tests' fake executors.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

class RunGate {
 public:
  explicit RunGate(bool open = false) : open_(open) {}

  // Counts one run as started, then blocks until the gate is open.
  void Pass() {
    absl::MutexLock lock(&mu_);
    ++started_;
    mu_.Await(absl::Condition(&open_));
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  // Blocks until `n` runs have reached the gate.
  void AwaitStarted(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return started_ >= n; };
    mu_.Await(absl::Condition(&reached));
  }
  int started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }

 private:
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_);
  int started_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attention::server
