// The server's one drain: every Attention and Sessions call passes this gate when it arrives, and
// leaves it once answered. On SIGTERM main closes the gate (new calls are answered UNAVAILABLE)
// and waits until every call that passed has been answered.
//
// Before gRPC's own shutdown closes the connections, main holds the refusals for a moment: a
// client waiting for its answer sends nothing new, so once calls stop arriving no call is left
// half-received when gRPC shuts down (gRPC 1.51 answers such calls CANCELLED, which clients do not
// retry). The held refusals are answered UNAVAILABLE once gRPC has queued its GOAWAY on every
// connection (main answers them right after grpc_server_shutdown_and_notify returns), so each
// client reads the GOAWAY before its answer and sends its next call elsewhere. What remains: a
// client that waits on no answer (it pauses between calls longer than the quiet, 250 ms) and sends
// in the moment between gRPC's shutdown beginning and its reading the GOAWAY.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/time/clock.h"
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

  // A call Enter turned away: `answer` (its UNAVAILABLE) runs now, or while holding, at
  // ReleaseHeld.
  void Refuse(absl::AnyInvocable<void() &&> answer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_refusal_ = absl::Now();
      if (holding_) {
        held_.push_back(std::move(answer));
        return;
      }
    }
    std::move(answer)();
  }
  // From now on refusals are held; returns once none has arrived for `quiet`, or after `max_wait`.
  void HoldUntilQuiet(absl::Duration quiet, absl::Duration max_wait) {
    const absl::Time give_up = absl::Now() + max_wait;
    std::unique_lock<std::mutex> lock(mu_);
    holding_ = true;
    const absl::Time held_since = absl::Now();
    while (true) {
      const absl::Time now = absl::Now();
      const absl::Time quiet_since = std::max(held_since, last_refusal_);
      if (now - quiet_since >= quiet || now >= give_up) return;
      lock.unlock();
      absl::SleepFor(std::min(quiet - (now - quiet_since), give_up - now));
      lock.lock();
    }
  }
  // Answers the held refusals; later ones are answered at once.
  void ReleaseHeld() {
    std::vector<absl::AnyInvocable<void() &&>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      holding_ = false;
      held.swap(held_);
    }
    for (auto& answer : held) std::move(answer)();
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
  bool holding_ = false;
  absl::Time last_refusal_ = absl::InfinitePast();
  std::vector<absl::AnyInvocable<void() &&>> held_;
};

}  // namespace attention::server
