// Threads a service starts for work that outlives the gRPC handler that began it (a request
// ring's server), so that gRPC's own threads never block. Each is joined once it has ended, when
// the owner reaps before starting the next, or at JoinAll: ended threads do not pile up. No lock of
// its own: the owner guards it with its own.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"

namespace attention::server {

class ServiceThreads {
 public:
  ServiceThreads() = default;
  ServiceThreads(ServiceThreads&&) = default;
  ServiceThreads& operator=(ServiceThreads&&) = default;
  ~ServiceThreads() { JoinAll(); }

  // Joins the threads whose work has ended; how many still run.
  int Reap() {
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (it->ended->load()) {
        it->thread.join();
        it = threads_.erase(it);
      } else {
        ++it;
      }
    }
    return static_cast<int>(threads_.size());
  }

  // Runs `work` on a thread of its own.
  void Start(absl::AnyInvocable<void() &&> work) {
    auto ended = std::make_shared<std::atomic<bool>>(false);
    std::thread thread([work = std::move(work), ended]() mutable {
      std::move(work)();
      work = nullptr;  // what it held goes before the thread counts as ended
      ended->store(true);
    });
    threads_.push_back(Started{std::move(thread), std::move(ended)});
  }

  // Waits for every thread. Move the threads out of the owner's lock first (a thread's work may
  // take that lock).
  void JoinAll() {
    for (Started& started : threads_) started.thread.join();
    threads_.clear();
  }

 private:
  struct Started {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> ended;
  };
  std::vector<Started> threads_;
};

}  // namespace attention::server
