// The CPU backend against the float64 reference on the standard grid, in every dtype, plus
// concurrent calls from several threads.
#include "kernels/cpu/cpu_attention.h"

#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/attention_test_grid.h"

namespace attention::kernel_test {
namespace {

cpu::CpuBackend& Backend() {
  static cpu::CpuBackend* backend = new cpu::CpuBackend();
  return *backend;
}

class CpuAttentionTest : public testing::TestWithParam<std::tuple<AttentionCase, DType>> {};

std::string ParamName(const testing::TestParamInfo<std::tuple<AttentionCase, DType>>& info) {
  return CaseName(std::get<0>(info.param), std::get<1>(info.param));
}

TEST_P(CpuAttentionTest, MatchesReference) {
  const auto& [c, dtype] = GetParam();
  CheckCase(
      c, dtype, [](const AttentionParams& p) { return Backend().Forward(p); },
      DefaultTolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(StandardGrid, CpuAttentionTest,
                         testing::Combine(testing::ValuesIn(StandardGrid()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3)),
                         ParamName);

// The open-model options (sinks, softcap, chunk size, V head dim) in every dtype.
INSTANTIATE_TEST_SUITE_P(OpenModelGrid, CpuAttentionTest,
                         testing::Combine(testing::ValuesIn(OpenModelGrid()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3)),
                         ParamName);

// Forward from several threads at once, each with its own case, on one shared backend (as the
// server's workers call it); also a single-thread backend, where callers share one worker.
TEST(CpuAttentionConcurrencyTest, ConcurrentCallsMatchReference) {
  const std::vector<AttentionCase> grid = StandardGrid();
  for (int threads : {1, 0}) {
    cpu::CpuBackend backend(cpu::CpuBackendOptions{.threads = threads});
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&, t] {
        for (size_t i = t; i < grid.size(); i += 4) {
          CheckCase(
              grid[i], DType::kFloat32,
              [&](const AttentionParams& p) { return backend.Forward(p); },
              DefaultTolerance(DType::kFloat32));
        }
      });
    }
    for (std::thread& caller : callers) caller.join();
  }
}

TEST(CpuAttentionTest, RejectsBadParams) {
  AttentionParams p;  // null pointers, zero shapes
  EXPECT_EQ(Backend().Forward(p).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attention::kernel_test
