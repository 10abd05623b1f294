// WaitBook (kernels/cuda/runtime/wait_book.h): the bookkeeping of the CUDA stream's bounded waits
// for callers' counters and events, on any host (no GPU: the waits' passing is the test's say).
#include "kernels/cuda/runtime/wait_book.h"

#include <random>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::cuda {
namespace {

using ::testing::HasSubstr;
using Kind = WaitBook::Kind;

constexpr absl::Duration kTimeout = absl::Seconds(60);

// Slots whose waits passed, as the CUDA side's events would say.
struct Passed {
  std::set<int> slots;
  bool operator()(const WaitBook::Wait& w) const { return slots.count(w.slot) > 0; }
};

std::vector<int> Slots(const std::vector<WaitBook::Wait>& waits) {
  std::vector<int> slots;
  for (const WaitBook::Wait& w : waits) slots.push_back(w.slot);
  return slots;
}

TEST(WaitBookTest, PassedWaitsLeaveAndLateOnesAreWrittenOnceAndRefusedOnce) {
  WaitBook book(kTimeout, 2);
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  uint64_t counter = 0, other = 0;
  ASSERT_EQ(book.Admit(Kind::kCounter, &counter), absl::OkStatus());
  book.Add(Kind::kCounter, &counter, 7, /*slot=*/0, t0);
  book.Add(Kind::kCounter, &other, 3, /*slot=*/1, t0 + absl::Seconds(1));
  Passed passed{{1}};

  // Before the deadline: the passed wait leaves, the other stays, nothing is written.
  WaitBook::Sweep sweep = book.Look(t0 + kTimeout - absl::Milliseconds(1), passed);
  EXPECT_THAT(Slots(sweep.passed), ::testing::ElementsAre(1));
  EXPECT_TRUE(sweep.late.empty());
  ASSERT_EQ(book.pending().size(), 1u);

  // At the deadline: late once, and it stays pending until its stream passes it.
  sweep = book.Look(t0 + kTimeout, passed);
  ASSERT_EQ(sweep.late.size(), 1u);
  EXPECT_EQ(sweep.late[0].value, 7u);
  EXPECT_EQ(sweep.late[0].key, &counter);
  EXPECT_TRUE(book.Look(t0 + 2 * kTimeout, passed).late.empty());
  EXPECT_EQ(book.pending().size(), 1u);
  EXPECT_EQ(book.stuck_gates(), 0);  // a counter holds no gate

  // The next wait naming the counter is refused once, naming the field, the value and the bound.
  const absl::Status refused = book.Admit(Kind::kCounter, &counter);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("ready_counter: an earlier Step's wait for value 7"));
  EXPECT_THAT(refused.message(), HasSubstr("1m (--stream_wait_timeout_s)"));
  EXPECT_EQ(book.Admit(Kind::kCounter, &counter), absl::OkStatus());
  // Another counter, or the same address as an event, was never late.
  EXPECT_EQ(book.Admit(Kind::kCounter, &other), absl::OkStatus());
  EXPECT_EQ(book.Admit(Kind::kEvent, &counter), absl::OkStatus());

  passed.slots.insert(0);
  sweep = book.Look(t0 + 3 * kTimeout, passed);
  EXPECT_THAT(Slots(sweep.passed), ::testing::ElementsAre(0));
  EXPECT_TRUE(sweep.passed[0].late);
  EXPECT_TRUE(book.pending().empty());
}

// Late event waits hold their gates until the event completes: at max_stuck_gates, further event
// waits are refused RESOURCE_EXHAUSTED (counters are not), until one drains.
TEST(WaitBookTest, StuckGatesAreCappedUntilTheirEventsComplete) {
  constexpr int kMaxStuck = 3;
  WaitBook book(kTimeout, kMaxStuck);
  const absl::Time t0 = absl::UnixEpoch();
  int events[kMaxStuck + 1];
  Passed passed;
  for (int i = 0; i < kMaxStuck; ++i) {
    ASSERT_EQ(book.Admit(Kind::kEvent, &events[i]), absl::OkStatus());
    book.Add(Kind::kEvent, &events[i], 1, /*slot=*/i, t0 + absl::Seconds(i));
  }
  // One passes in time: never stuck.
  passed.slots.insert(0);
  EXPECT_THAT(Slots(book.Look(t0 + absl::Seconds(5), passed).passed), ::testing::ElementsAre(0));
  passed.slots.clear();
  ASSERT_EQ(book.Admit(Kind::kEvent, &events[kMaxStuck]), absl::OkStatus());
  book.Add(Kind::kEvent, &events[kMaxStuck], 1, /*slot=*/kMaxStuck, t0 + absl::Seconds(6));
  EXPECT_EQ(book.Look(t0 + absl::Seconds(6) + kTimeout, passed).late.size(), size_t{kMaxStuck});
  EXPECT_EQ(book.stuck_gates(), kMaxStuck);

  int fresh;
  const absl::Status full = book.Admit(Kind::kEvent, &fresh);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(full.message(), HasSubstr("ready_event: expected fewer than 3"));
  EXPECT_THAT(full.message(), HasSubstr("got 3"));
  uint64_t counter;
  EXPECT_EQ(book.Admit(Kind::kCounter, &counter), absl::OkStatus());

  // A late event's own key is refused FAILED_PRECONDITION first (the late Step's results).
  const absl::Status late = book.Admit(Kind::kEvent, &events[1]);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_THAT(late.message(), HasSubstr("ready_event: an earlier Step's wait for this event"));

  // One event completes: its gate drains, and a new event wait is admitted.
  passed.slots.insert(2);
  const WaitBook::Sweep sweep = book.Look(t0 + absl::Hours(1), passed);
  EXPECT_THAT(Slots(sweep.passed), ::testing::ElementsAre(2));
  EXPECT_TRUE(sweep.late.empty());
  EXPECT_EQ(book.stuck_gates(), kMaxStuck - 1);
  EXPECT_EQ(book.Admit(Kind::kEvent, &fresh), absl::OkStatus());
}

// Random waits, passes and looks against a plain model: every wait leaves exactly once, is late
// at most once and only at or past its deadline, and the stuck count is the late event waits
// pending.
TEST(WaitBookTest, RandomSchedulesKeepTheBooks) {
  std::mt19937 rng(20261205);
  WaitBook book(kTimeout, 1 << 20);
  int keys[64];
  absl::Time now = absl::UnixEpoch();
  Passed passed;
  std::set<int> pending, late;
  std::vector<absl::Time> deadline;
  std::vector<Kind> kind;
  for (int round = 0; round < 2000; ++round) {
    switch (rng() % 3) {
      case 0: {
        const int slot = static_cast<int>(deadline.size());
        kind.push_back(rng() % 2 ? Kind::kEvent : Kind::kCounter);
        deadline.push_back(now + kTimeout);
        book.Add(kind.back(), &keys[rng() % 64], rng(), slot, now);
        pending.insert(slot);
        break;
      }
      case 1:
        if (!pending.empty()) passed.slots.insert(deadline.size() - 1 - rng() % deadline.size());
        break;
      default:
        now += absl::Seconds(rng() % 40);
        const WaitBook::Sweep sweep = book.Look(now, passed);
        for (const WaitBook::Wait& w : sweep.passed) {
          ASSERT_TRUE(passed.slots.count(w.slot));
          ASSERT_EQ(pending.erase(w.slot), 1u);
        }
        for (const WaitBook::Wait& w : sweep.late) {
          ASSERT_GE(now, deadline[w.slot]);
          ASSERT_FALSE(passed.slots.count(w.slot));
          ASSERT_TRUE(late.insert(w.slot).second);
        }
        int stuck = 0;
        for (int slot : pending) {
          ASSERT_FALSE(passed.slots.count(slot));
          ASSERT_EQ(late.count(slot) > 0, now >= deadline[slot]);
          stuck += late.count(slot) > 0 && kind[slot] == Kind::kEvent;
        }
        ASSERT_EQ(book.stuck_gates(), stuck);
        ASSERT_EQ(book.pending().size(), pending.size());
    }
  }
}

}  // namespace
}  // namespace attention::cuda
