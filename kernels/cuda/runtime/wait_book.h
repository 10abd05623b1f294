// The bookkeeping of a stream's bounded waits for its callers (counter_waits.h), apart from CUDA so
// that it is tested on any host: the waits pending and until when, the callers' counters and
// events whose wait timed out (the next Step naming one is refused, once), and how many of the
// gates that wait for callers' events are stuck on one that has not completed.
//
// Host-only C++ (no CUDA header): built in every configuration (attention_cuda_wait_book).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attention::cuda {

class WaitBook {
 public:
  // What a wait is for: a caller's ready_counter, or its ready_event (through a gate).
  enum class Kind { kCounter, kEvent };
  struct Wait {
    Kind kind;
    const void* key;  // the caller's counter or event
    uint64_t value;   // awaited: the caller's (counters) or the gate's counter value (events)
    int slot;         // the waiter's index of what shows the wait passed (an event, a gate)
    absl::Time deadline;
    bool late = false;  // past its deadline: its value written by the watcher
  };
  struct Sweep {
    std::vector<Wait> passed;  // left the book: their slots are free again
    std::vector<Wait> late;    // past their deadline just now: the watcher writes their values
  };

  // `timeout`: --stream_wait_timeout_s. `max_stuck_gates`: event waits past their deadline whose
  // event has still not completed, at most (each holds a gate: a stream and a counter).
  WaitBook(absl::Duration timeout, int max_stuck_gates)
      : timeout_(timeout), max_stuck_gates_(max_stuck_gates) {}

  // Whether a wait on `key` may be queued: FAILED_PRECONDITION naming the field (ready_counter,
  // ready_event), once, when an earlier wait on it timed out (that Step read inputs that were not
  // ready); RESOURCE_EXHAUSTED naming ready_event for an event while max_stuck_gates are stuck.
  absl::Status Admit(Kind kind, const void* key);
  void Add(Kind kind, const void* key, uint64_t value, int slot, absl::Time now);

  // One look at `now`: waits that `passed` (their stream got past them) leave the book; those
  // past their deadline, not passed and not yet late, become late (their keys refused once).
  Sweep Look(absl::Time now, absl::FunctionRef<bool(const Wait&)> passed);

  const std::vector<Wait>& pending() const { return pending_; }
  // Event waits that are late and still pending: their gates wait for an event not completed.
  int stuck_gates() const;

 private:
  const absl::Duration timeout_;
  const int max_stuck_gates_;
  std::vector<Wait> pending_;
  // (kind, key) of the waits that timed out, with the value awaited (counters' messages).
  absl::flat_hash_map<std::pair<Kind, const void*>, uint64_t> timed_out_;
};

}  // namespace attention::cuda
