// The CUDA backend against the float64 reference: the standard grid in every dtype, larger
// multi-tile cases, and the errors it returns. Every case runs once per forward kernel variant
// (kForwardVariants), forced, the variant named in the test name. Tests that need a GPU skip, with
// a message, on machines without one, and a variant skips on a GPU it cannot run on; the error
// checks run everywhere.
#include "kernels/cuda/forward/cuda_attention.h"

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/forward/forward_plan.h"
#include "kernels/cuda/runtime/host_runner.h"
#include "tests/kernels/attention_test_grid.h"

namespace attention::kernel_test {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A runner on device 0 forcing `variant` (one per variant, kept for the whole test run): copies
// host inputs to the device, poisons o and lse there with NaN, runs, copies back.
absl::StatusOr<cuda::HostRunner*> Runner(cuda::ForwardVariant variant) {
  static auto* const runners =
      new std::map<cuda::ForwardVariant, std::unique_ptr<cuda::HostRunner>>;
  std::unique_ptr<cuda::HostRunner>& runner = (*runners)[variant];
  if (runner == nullptr) {
    absl::StatusOr<std::unique_ptr<cuda::HostRunner>> made =
        cuda::HostRunner::Create({.device = 0, .poison_outputs = true, .forward_variant = variant});
    if (!made.ok()) return made.status();
    runner = std::move(*made);
  }
  return runner.get();
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped"

// The plan of device 0 for case c in dtype forced on `variant` (as the runner launches it: head
// dim padded to a multiple of 8), else why not: FAILED_PRECONDITION when the device lacks what the
// variant needs (compute capability, shared memory), INVALID_ARGUMENT for a dtype the variant does
// not take (the unforced plan runs those on the next variant: wgmma_sm90 leaves float32 to
// mma_sm80). float8 the variant does not read natively runs its bfloat16 kernel on dequantised
// copies (HostRunner): that plan then.
absl::StatusOr<cuda::ForwardPlan> DevicePlan(cuda::ForwardVariant variant, const AttentionCase& c,
                                             DType dtype) {
  const absl::StatusOr<cuda::DeviceCaps> caps = cuda::GetDeviceCaps(0);
  if (!caps.ok()) return caps.status();
  AttentionParams probe;
  probe.dtype = dtype;
  probe.head_dim = (c.head_dim + 7) / 8 * 8;
  static constexpr int32_t kVarlen[1] = {0};  // the plan only asks whether the call is varlen
  if (c.is_varlen()) probe.cu_seqlens_q = probe.cu_seqlens_k = kVarlen;
  absl::StatusOr<cuda::ForwardPlan> plan = cuda::PlanFlashForward(probe, *caps, variant);
  if (dtype == DType::kFloat8E4M3 && absl::IsInvalidArgument(plan.status())) {
    probe.dtype = DType::kBFloat16;
    plan = cuda::PlanFlashForward(probe, *caps, variant);
  }
  return plan;
}

using Param = std::tuple<AttentionCase, DType, cuda::ForwardVariant>;

std::string ParamName(const testing::TestParamInfo<Param>& info) {
  const auto& [c, dtype, variant] = info.param;
  return absl::StrCat(CaseName(c, dtype), "_", cuda::ForwardVariantName(variant));
}

class CudaAttentionTest : public testing::TestWithParam<Param> {};

TEST_P(CudaAttentionTest, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& [c, dtype, variant] = GetParam();
  const absl::StatusOr<cuda::ForwardPlan> plan = DevicePlan(variant, c, dtype);
  if (!plan.ok()) {
    if (plan.status().code() == absl::StatusCode::kFailedPrecondition ||
        plan.status().code() == absl::StatusCode::kInvalidArgument) {
      GTEST_SKIP() << plan.status();
    }
    FAIL() << plan.status();
  }
  const absl::StatusOr<cuda::HostRunner*> runner = Runner(variant);
  ASSERT_TRUE(runner.ok()) << runner.status();
  // Native float8 rounds P to e4m3; dequantised float8 keeps bfloat16's bound.
  const bool rounds_p_to_float8 = plan->dtype == DType::kFloat8E4M3;
  CheckCase(
      c, dtype, [&](const AttentionParams& host) { return (*runner)->Run(host).status(); },
      rounds_p_to_float8 ? Float8RoundedPTolerance() : DefaultTolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(StandardGrid, CudaAttentionTest,
                         testing::Combine(testing::ValuesIn(StandardGrid()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3),
                                          testing::ValuesIn(cuda::kForwardVariants)),
                         ParamName);

// The standard grid's head-dim-64 cases again at head dim 128, float8 only: on Hopper the native
// e4m3 path (ragged sizes, Nq != Nk, GQA, masks, large magnitudes, poisoned keys), which runs
// from head dim 128 (at 64 float8 is dequantised to bfloat16 first).
std::vector<AttentionCase> StandardGridAtD128() {
  std::vector<AttentionCase> cases;
  for (AttentionCase c : StandardGrid()) {
    if (c.head_dim != 64) continue;
    c.head_dim = 128;
    c.name += "_d128";
    cases.push_back(std::move(c));
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Float8AtD128, CudaAttentionTest,
                         testing::Combine(testing::ValuesIn(StandardGridAtD128()),
                                          testing::Values(DType::kFloat8E4M3),
                                          testing::ValuesIn(cuda::kForwardVariants)),
                         ParamName);

// Many key tiles per CTA (the cp.async pipeline, causal tile skipping, ragged last tiles) in each
// specialised head dim, and head dims served by the next specialisation up.
std::vector<AttentionCase> LargeCases() {
  std::vector<AttentionCase> cases;
  auto square = [](const char* name, int64_t n, int64_t d, bool causal) {
    AttentionCase c;
    c.name = name;
    c.heads_q = c.heads_kv = 1;
    c.seqlen_q = c.seqlen_k = n;
    c.head_dim = d;
    c.window_right = causal ? 0 : kUnboundedWindow;
    c.return_lse = true;
    return c;
  };
  cases.push_back(square("n1000_d64_causal", 1000, 64, true));
  cases.push_back(square("n4097_d64_causal", 4097, 64, true));
  cases.push_back(square("n1000_d128", 1000, 128, false));
  // Past 2048 query rows the Hopper kernel's D = 64 tile has three consumer warpgroups.
  AttentionCase gqa64 = square("n2100_d64_gqa", 2100, 64, false);
  gqa64.heads_q = 4;
  gqa64.heads_kv = 2;
  cases.push_back(gqa64);
  cases.push_back(square("n1000_d256_causal", 1000, 256, true));
  cases.push_back(square("n777_d200_causal", 777, 200, true));
  AttentionCase c = square("nq1000_nk4097_d128_causal_bshd_gqa", 0, 128, true);
  c.seqlen_q = 1000;
  c.seqlen_k = 4097;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.layout = Layout::kBSHD;
  cases.push_back(c);
  c = square("n2000_d128_window_300_40", 2000, 128, false);
  c.window_left = 300;
  c.window_right = 40;
  cases.push_back(c);
  // The kernel runs a negative scale as |scale| on -Q, and a zero scale as the smallest normal.
  c = square("n300_d64_causal_negative_scale", 300, 64, true);
  c.softmax_scale = -0.2f;
  cases.push_back(c);
  c = square("n200_d128_zero_scale", 200, 128, false);
  c.softmax_scale = 0.0f;
  cases.push_back(c);
  c = AttentionCase();
  c.name = "varlen_long_d64_causal";
  c.heads_q = 2;
  c.heads_kv = 1;
  c.varlen_q = {1500, 3, 700};
  c.varlen_k = {1500, 900, 2100};
  c.window_right = 0;
  c.return_lse = true;
  cases.push_back(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Large, CudaAttentionTest,
                         testing::Combine(testing::ValuesIn(LargeCases()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3),
                                          testing::ValuesIn(cuda::kForwardVariants)),
                         ParamName);

// Forward's own checks, before any device work (so they run without a GPU): fake device pointers.
AttentionParams FakeParams(DType dtype, int64_t head_dim) {
  AttentionParams p;
  p.dtype = dtype;
  alignas(16) static char buffer[64];
  p.q = p.k = p.v = p.o = buffer;
  p.batch = p.heads_q = p.heads_kv = 1;
  p.seqlen_q = p.seqlen_k = 8;
  p.head_dim = head_dim;
  p.SetContiguousStrides(Layout::kBHSD);
  return p;
}

TEST(CudaAttentionErrorsTest, HeadDimNotMultipleOf8IsUnimplemented) {
  const absl::Status s = cuda::Forward(FakeParams(DType::kFloat16, 12), nullptr, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("cuda backend"), std::string::npos) << s;
}

TEST(CudaAttentionErrorsTest, HeadDimAbove256IsUnimplemented) {
  EXPECT_EQ(cuda::Forward(FakeParams(DType::kBFloat16, 264), nullptr, {}).code(),
            absl::StatusCode::kUnimplemented);
}

TEST(CudaAttentionErrorsTest, MisalignedPointerIsUnimplemented) {
  AttentionParams p = FakeParams(DType::kFloat32, 64);
  p.k = static_cast<const char*>(p.k) + 4;
  const absl::Status s = cuda::Forward(p, nullptr, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s;
}

TEST(CudaAttentionErrorsTest, BadParamsAreInvalidArgument) {
  AttentionParams p;  // null pointers, zero shapes
  EXPECT_EQ(cuda::Forward(p, nullptr, {}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attention::kernel_test
