// kernels/status_macros.h: RETURN_IF_ERROR and ASSIGN_OR_RETURN return the first error and pass
// values through, in functions returning Status and StatusOr, with declared and existing lhs.
#include "kernels/status_macros.h"

#include <memory>

#include "gtest/gtest.h"

namespace attention {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<std::unique_ptr<int>> Boxed(int x) {
  if (x < 0) return absl::OutOfRangeError("negative");
  return std::make_unique<int>(x);
}

absl::Status Check(int x) {
  return x == 0 ? absl::FailedPreconditionError("zero") : absl::OkStatus();
}

// Status-returning: both macros, two ASSIGN_OR_RETURN on consecutive lines.
absl::Status Quarter(int x, int& out) {
  RETURN_IF_ERROR(Check(x));
  ASSIGN_OR_RETURN(auto half, Half(x));
  ASSIGN_OR_RETURN(out, Half(half));
  return absl::OkStatus();
}

// StatusOr-returning, with a move-only value.
absl::StatusOr<int> Unbox(int x) {
  ASSIGN_OR_RETURN(std::unique_ptr<int> p, Boxed(x));
  RETURN_IF_ERROR(Check(*p));
  return *p + 1;
}

TEST(StatusMacrosTest, PassesValuesThrough) {
  int out = 0;
  EXPECT_TRUE(Quarter(12, out).ok());
  EXPECT_EQ(out, 3);
  const absl::StatusOr<int> v = Unbox(4);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 5);
}

TEST(StatusMacrosTest, ReturnsTheFirstError) {
  int out = -1;
  EXPECT_EQ(Quarter(0, out).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Quarter(7, out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(6, out).code(), absl::StatusCode::kInvalidArgument);  // 6 / 2 is odd
  EXPECT_EQ(out, -1);  // never assigned on an error
  EXPECT_EQ(Unbox(-1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Unbox(0).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace attention
