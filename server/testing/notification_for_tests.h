// Tests only: absl::Notification's interface on std::mutex and std::condition_variable. The
// system's abseil is not built for ThreadSanitizer, so a result handed over through an
// absl::Notification would read as a race; pthread locks are seen.
#pragma once

#include <condition_variable>
#include <mutex>

namespace attention::server {

class Notification {
 public:
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    notified_ = true;
    notified_cv_.notify_all();
  }
  bool HasBeenNotified() {
    std::lock_guard<std::mutex> lock(mu_);
    return notified_;
  }
  void WaitForNotification() {
    std::unique_lock<std::mutex> lock(mu_);
    notified_cv_.wait(lock, [this] { return notified_; });
  }

 private:
  std::mutex mu_;  // guards notified_; a pthread lock, which ThreadSanitizer sees
  std::condition_variable notified_cv_;
  bool notified_ = false;
};

}  // namespace attention::server
