// IpcEvents: the event cache, through hooks that count what they open and close (the CUDA calls
// behind the real hooks run in the GPU suites: tests/kernels/paged_kv_pool_test.cc and the
// stream-order check of bench/torch/cuda_regions_check.py).
#include "server/regions/ipc_events.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// Hooks whose events are ints: each open makes a new one, each close records it.
struct CountingHooks {
  std::vector<int> opened, closed;
  EventHooks Hooks() {
    return {.open = [this](absl::string_view handle, int device) -> absl::StatusOr<void*> {
              if (handle[0] == 'x') return absl::InternalError("the driver refused it");
              opened.push_back(static_cast<int>(opened.size()) + 1);
              return static_cast<void*>(new int(opened.back() + 100 * device));
            },
            .close =
                [this](void* event, int) {
                  closed.push_back(*static_cast<int*>(event));
                  delete static_cast<int*>(event);
                }};
  }
};

std::string Handle(char c) { return std::string(64, c); }

TEST(IpcEventsTest, OpensEachHandleOncePerDevice) {
  CountingHooks hooks;
  {
    IpcEvents events(hooks.Hooks());
    absl::StatusOr<std::shared_ptr<void>> a = events.Open("ready_event", Handle('a'), 0);
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<std::shared_ptr<void>> again = events.Open("ready_event", Handle('a'), 0);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(a->get(), again->get());
    absl::StatusOr<std::shared_ptr<void>> other_device = events.Open("done_event", Handle('a'), 1);
    ASSERT_TRUE(other_device.ok()) << other_device.status();
    EXPECT_NE(a->get(), other_device->get());
    EXPECT_EQ(hooks.opened.size(), 2u);
    EXPECT_TRUE(hooks.closed.empty());
  }
  EXPECT_EQ(hooks.closed.size(), 2u);  // every event closed once the cache and holders are gone
}

TEST(IpcEventsTest, TheLeastRecentlyUsedGoesOnceNobodyHoldsIt) {
  CountingHooks hooks;
  IpcEvents events(hooks.Hooks(), /*capacity=*/2);
  absl::StatusOr<std::shared_ptr<void>> held = events.Open("ready_event", Handle('a'), 0);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(events.Open("ready_event", Handle('b'), 0).ok());
  ASSERT_TRUE(events.Open("ready_event", Handle('c'), 0).ok());  // drops 'a' from the cache
  EXPECT_TRUE(hooks.closed.empty());                             // but a step still holds it
  held->reset();
  EXPECT_THAT(hooks.closed, ::testing::ElementsAre(1));
  ASSERT_TRUE(events.Open("ready_event", Handle('a'), 0).ok());  // opened again
  EXPECT_EQ(hooks.opened.size(), 4u);
}

TEST(IpcEventsTest, RefusesBadHandlesNamingTheField) {
  CountingHooks hooks;
  IpcEvents events(hooks.Hooks());
  absl::StatusOr<std::shared_ptr<void>> short_handle = events.Open("done_event", "abc", 0);
  EXPECT_EQ(short_handle.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_handle.status().message(),
              HasSubstr("done_event: expected a 64-byte cudaIpcEventHandle_t, got 3 bytes"));
  absl::StatusOr<std::shared_ptr<void>> refused = events.Open("ready_event", Handle('x'), 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("ready_event: the driver refused it"));
  EXPECT_TRUE(hooks.opened.empty());

  IpcEvents none(EventHooks{});
  EXPECT_EQ(none.Open("ready_event", Handle('a'), 0).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace attention::server
