// The CUDA backend against the float64 reference: the standard grid in every dtype, larger
// multi-tile cases, the open-model options it serves (sinks, softcap, chunk_size: the kernels'
// options instances) on small and multi-tile cases, and the errors it returns (a V head dim of
// its own refused by name). Every case runs once per forward kernel variant
// (kForwardVariants), forced, the variant named in the test name. Tests that need a GPU skip, with
// a message, on machines without one, and a variant skips on a GPU it cannot run on; the error
// checks run everywhere.
#include "kernels/cuda/forward/cuda_attention.h"

#include <cuda_runtime_api.h>

#include <limits>
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
// mma_sm80). float8 the variant does not read natively (with options: never) runs its bfloat16
// kernel on dequantised copies (HostRunner): that plan then.
absl::StatusOr<cuda::ForwardPlan> DevicePlan(cuda::ForwardVariant variant, const AttentionCase& c,
                                             DType dtype) {
  const absl::StatusOr<cuda::DeviceCaps> caps = cuda::GetDeviceCaps(0);
  if (!caps.ok()) return caps.status();
  AttentionParams probe;
  probe.dtype = dtype;
  probe.head_dim = (c.head_dim + 7) / 8 * 8;
  static constexpr int32_t kVarlen[1] = {0};  // the plan only asks whether the call is varlen
  if (c.is_varlen()) probe.cu_seqlens_q = probe.cu_seqlens_k = kVarlen;
  static constexpr float kSink[1] = {0.0f};  // the plan only asks whether there are sinks
  probe.sinks = c.sinks ? kSink : nullptr;
  probe.softcap = c.softcap;
  probe.chunk_size = c.chunk_size;
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

// The open-model options the kernels serve, on the shared grid's small cases (every option alone
// and together, ragged, Nq != Nk, GQA, causal, windows, varlen top-left with NaN in V outside
// rows' chunks).
INSTANTIATE_TEST_SUITE_P(OpenModelGrid, CudaAttentionTest,
                         testing::Combine(testing::ValuesIn(OpenModelGridSameVHeadDim()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16, DType::kFloat8E4M3),
                                          testing::ValuesIn(cuda::kForwardVariants)),
                         ParamName);

// The options over many key and query tiles of each kernel's tiles: chunks of 1 key, one off
// either side of a key tile (mma_sm80: 64 keys at D 64 and 128, 32 at 256; wgmma_sm90: 128, and 80
// at 256) and of a query tile (wgmma_sm90 at D 64: 192 rows), primes, longer than Nk; with causal
// and windowed masks in both alignments, GQA, Nq != Nk both ways (rows that see no key: o = 0,
// lse = the sink), BSHD, varlen, negative scales and softcaps that bite (logits well past them).
std::vector<AttentionCase> LargeOptionCases() {
  constexpr auto kV = AttentionCase::PoisonTarget::kV;
  constexpr auto kK = AttentionCase::PoisonTarget::kK;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  // Every case returns its LSE; one with a softcap gets logits of a few units (inputs times 2),
  // so that softcaps of 2.5 and 5 bend them.
  auto with_lse = [](AttentionCase c) {
    c.return_lse = true;
    if (c.softcap > 0) c.input_scale = 2.0f;
    return c;
  };
  const AttentionCase cases[] = {
      {.name = "n1000_d64_causal_chunk1_sinks",
       .heads_q = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .window_right = 0,
       .sinks = true,
       .chunk_size = 1},
      {.name = "n1000_d64_causal_chunk63_sinks",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .window_right = 0,
       .sinks = true,
       .chunk_size = 63},
      {.name = "n1000_d64_chunk65_softcap",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .softcap = 5,
       .chunk_size = 65},
      {.name = "n1500_d64_causal_chunk191",
       .seqlen_q = 1500,
       .seqlen_k = 1500,
       .window_right = 0,
       .chunk_size = 191},
      {.name = "n1500_d64_chunk193_sinks_softcap",
       .heads_q = 2,
       .seqlen_q = 1500,
       .seqlen_k = 1500,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 193},
      {.name = "nq1000_nk1500_d64_topleft_causal_chunk100_bshd_softcap",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1500,
       .layout = Layout::kBSHD,
       .window_right = 0,
       .mask_alignment = MaskAlignment::kTopLeft,
       .softcap = 5,
       .chunk_size = 100},
      {.name = "nq1000_nk300_d64_causal_chunk131_sinks",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 300,
       .window_right = 0,
       .sinks = true,
       .chunk_size = 131},
      {.name = "n1000_d128_causal_chunk127_softcap_sinks",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .window_right = 0,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 127},
      {.name = "n500_d128_causal_negative_scale_all",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 500,
       .seqlen_k = 500,
       .head_dim = 128,
       .window_right = 0,
       .softmax_scale = -0.3f,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 127},
      {.name = "n1000_d128_chunk129",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .chunk_size = 129},
      {.name = "n1000_d128_softcap",
       .heads_q = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .softcap = 2.5f},
      {.name = "n1000_d128_causal_sinks",
       .heads_q = 4,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .window_right = 0,
       .sinks = true},
      {.name = "n1000_d128_causal_chunk5000_sinks",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .window_right = 0,
       .sinks = true,
       .chunk_size = 5000},
      {.name = "nq300_nk1000_d128_chunk97_gqa",
       .heads_q = 4,
       .heads_kv = 2,
       .seqlen_q = 300,
       .seqlen_k = 1000,
       .head_dim = 128,
       .chunk_size = 97},
      {.name = "n2000_d128_window_300_40_chunk256_all",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 2000,
       .seqlen_k = 2000,
       .head_dim = 128,
       .window_left = 300,
       .window_right = 40,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 256},
      // Non-finite V and K at keys outside some rows' chunks (no window: the chunks alone mask
      // them).
      {.name = "n1000_d128_chunk129_poison_v_inf",
       .heads_q = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .chunk_size = 129,
       .poison_target = kV,
       .poison = kInf,
       .poison_keys = {5, 300, 999}},
      {.name = "n1000_d128_chunk129_poison_k_nan",
       .heads_q = 2,
       .seqlen_q = 1000,
       .seqlen_k = 1000,
       .head_dim = 128,
       .chunk_size = 129,
       .poison_target = kK,
       .poison = kNan,
       .poison_keys = {5, 300, 999}},
      {.name = "n700_d256_causal_chunk79_softcap",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 700,
       .seqlen_k = 700,
       .head_dim = 256,
       .window_right = 0,
       .softcap = 5,
       .chunk_size = 79},
      {.name = "n700_d256_chunk81_sinks",
       .heads_q = 2,
       .seqlen_q = 700,
       .seqlen_k = 700,
       .head_dim = 256,
       .sinks = true,
       .chunk_size = 81},
      {.name = "n700_d256_causal_chunk31_all",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 700,
       .seqlen_k = 700,
       .head_dim = 256,
       .window_right = 0,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 31},
      {.name = "n777_d200_causal_chunk33_all",
       .heads_q = 2,
       .heads_kv = 2,
       .seqlen_q = 777,
       .seqlen_k = 777,
       .head_dim = 200,
       .window_right = 0,
       .sinks = true,
       .softcap = 5,
       .chunk_size = 33},
      {.name = "varlen_long_d64_causal_chunk200_all",
       .heads_q = 2,
       .window_right = 0,
       .varlen_q = {1500, 3, 700},
       .varlen_k = {1500, 900, 2100},
       .sinks = true,
       .softcap = 5,
       .chunk_size = 200},
  };
  std::vector<AttentionCase> out;
  for (const AttentionCase& c : cases) out.push_back(with_lse(c));
  return out;
}

INSTANTIATE_TEST_SUITE_P(LargeOptions, CudaAttentionTest,
                         testing::Combine(testing::ValuesIn(LargeOptionCases()),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16),
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

TEST(CudaAttentionErrorsTest, OwnVHeadDimIsRefusedByName) {
  AttentionParams p = FakeParams(DType::kBFloat16, 64);
  p.v_head_dim = 32;
  p.softcap = 5.0f;  // served: not named
  const absl::Status s = cuda::Forward(p, nullptr, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("v_head_dim"), std::string::npos) << s;
  EXPECT_NE(s.message().find("cuda"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("softcap"), std::string::npos) << s;
}

// The served options reach the kernels' params: the softcap in the log2 domain (the softmax then
// at scale 1), chunks (the longest as 2^30), sinks left to LaunchForward; chunks on sequences of
// 2^30 rows or more are refused by name.
TEST(CudaAttentionErrorsTest, ServedOptionsBecomeKernelParams) {
  AttentionParams p = FakeParams(DType::kFloat16, 64);
  const float sinks[1] = {0.5f};
  p.sinks = sinks;
  p.softcap = 4.0f;
  p.softmax_scale = -0.5f;
  p.chunk_size = int64_t{1} << 40;
  const absl::StatusOr<cuda::KernelParams> k = cuda::ToKernelParams(p);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_FLOAT_EQ(k->softcap_log2, 4.0f * cuda::kLog2e);
  EXPECT_FLOAT_EQ(k->softcap_scale, 0.5f / 4.0f);
  EXPECT_EQ(k->scale_log2, 1.0f);
  EXPECT_TRUE(k->negate_q);
  EXPECT_EQ(k->chunk_size, 1 << 30);
  EXPECT_EQ(k->sinks, nullptr);
  p.chunk_size = 0;
  p.softcap = 0.0f;
  const absl::StatusOr<cuda::KernelParams> plain = cuda::ToKernelParams(p);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(cuda::HasOptions(*plain));  // sinks join at launch (LaunchForward)
  p.chunk_size = 16;
  p.seqlen_k = int64_t{1} << 30;
  const absl::Status long_chunked = cuda::ToKernelParams(p).status();
  EXPECT_EQ(long_chunked.code(), absl::StatusCode::kUnimplemented) << long_chunked;
  EXPECT_NE(long_chunked.message().find("chunk_size"), std::string::npos) << long_chunked;
}

TEST(CudaAttentionErrorsTest, BadParamsAreInvalidArgument) {
  AttentionParams p;  // null pointers, zero shapes
  EXPECT_EQ(cuda::Forward(p, nullptr, {}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attention::kernel_test
