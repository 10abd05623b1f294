// Tests only: a gate that holds executor runs until the test opens it, and lets the test wait until
// a number of runs have reached it. Shared by the scheduler and service tests' fake executors.
#pragma once

#include <condition_variable>
#include <mutex>

namespace attention::server {

class RunGate {
 public:
  explicit RunGate(bool open = false) : open_(open) {}

  // Counts one run as started, then blocks until the gate is open.
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    ++started_;
    changed_.notify_all();
    changed_.wait(lock, [this] { return open_; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    changed_.notify_all();
  }
  // Blocks until `n` runs have reached the gate.
  void AwaitStarted(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [this, n] { return started_ >= n; });
  }
  int started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }

 private:
  std::mutex mu_;  // guards the two below; a pthread lock, which ThreadSanitizer sees
  std::condition_variable changed_;  // open_ or started_ changed
  bool open_;
  int started_ = 0;
};

}  // namespace attention::server
