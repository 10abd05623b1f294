// The CUDA backend's host-side rules, without a GPU: the forward plan (variant names, forcing,
// what a device's caps rule out; hand-made caps, so no CUDA call), the host runner's float8 path,
// the CUDA status codes, the specialised head dims, the paged decode plan's kernel and kernel
// params for the open-model options, and the wgmma descriptor arithmetic.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/decode/paged_decode.h"
#include "kernels/cuda/forward/forward_plan.h"
#include "kernels/cuda/forward/sm90_schedule.h"
#include "kernels/cuda/ops/cuda_status.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/ops/smem_desc.h"
#include "kernels/cuda/prep/dequantise.h"
#include "kernels/cuda/runtime/host_runner.h"

namespace attention::cuda {
namespace {

// H200: compute capability 9.0, 132 SMs, 227 KiB of shared memory per block.
constexpr DeviceCaps kH200 = {
    .compute_capability = 90, .sm_count = 132, .smem_per_block_optin = 232448};
// An RTX 3090 (8.6): 99 KiB per block.
constexpr DeviceCaps kSm86 = {
    .compute_capability = 86, .sm_count = 82, .smem_per_block_optin = 101376};
// A T4 (7.5): before mma.sync bfloat16 and cp.async.
constexpr DeviceCaps kSm75 = {
    .compute_capability = 75, .sm_count = 40, .smem_per_block_optin = 65536};

AttentionParams Params(DType dtype, int64_t head_dim) {
  AttentionParams p;
  p.dtype = dtype;
  p.head_dim = head_dim;
  return p;
}

bool Mentions(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != absl::string_view::npos;
}

TEST(ForwardVariantTest, NamesRoundTripAndSuitTestNames) {
  for (ForwardVariant v : kForwardVariants) {
    const absl::string_view name = ForwardVariantName(v);
    EXPECT_FALSE(name.empty());
    for (char c : name) EXPECT_TRUE((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
    const absl::StatusOr<ForwardVariant> parsed = ParseForwardVariant(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, v);
  }
  EXPECT_EQ(ForwardVariantName(ForwardVariant::kMmaSm80), "mma_sm80");
}

TEST(ForwardVariantTest, UnknownNameIsInvalidArgumentListingTheNames) {
  const absl::StatusOr<ForwardVariant> parsed = ParseForwardVariant("wgmma_sm70");
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(parsed.status(), "wgmma_sm70")) << parsed.status();
  EXPECT_TRUE(Mentions(parsed.status(), "mma_sm80")) << parsed.status();
}

// The wgmma kernel is planned only where the build made sm_90a code (CI's default, 80;90a).
#define SKIP_WITHOUT_SM90A()                                     \
  if (!WgmmaSm90InBuild())                                       \
  GTEST_SKIP() << "this build makes no sm_90a code: wgmma_sm90 " \
                  "is not offered"

TEST(PlanFlashForwardTest, WithoutSm90aCodeTheWgmmaKernelIsNotOffered) {
  if (WgmmaSm90InBuild()) GTEST_SKIP() << "this build holds the wgmma_sm90 kernel";
  const absl::StatusOr<ForwardPlan> forced =
      PlanFlashForward(Params(DType::kBFloat16, 64), kH200, ForwardVariant::kWgmmaSm90);
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kFailedPrecondition);
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(Params(DType::kBFloat16, 64), kH200);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->variant, ForwardVariant::kMmaSm80);
}

TEST(PlanFlashForwardTest, PicksTheSpecialisationAndItsSharedMemory) {
  SKIP_WITHOUT_SM90A();
  for (ForwardVariant v : kForwardVariants) {
    const absl::StatusOr<ForwardPlan> plan =
        PlanFlashForward(Params(DType::kBFloat16, 96), kH200, v);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->variant, v);
  }
  // Off Hopper: the mma.sync kernel, Q tile of 128 rows + 2 K and 2 V tiles of 64 rows, 128
  // bfloat16 each.
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(Params(DType::kBFloat16, 96), kSm86);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->variant, ForwardVariant::kMmaSm80);
  EXPECT_EQ(plan->dtype, DType::kBFloat16);
  EXPECT_EQ(plan->kernel_head_dim, 128);
  EXPECT_EQ(plan->smem_bytes, (128 + 4 * 64) * 128 * 2);
  // On Hopper: the wgmma kernel, a Q tile of 128 rows + 2 stages of K and V tiles of 128 rows +
  // the O tile of 128 rows, 128 bfloat16 each, 1 KiB of alignment slack, 11 mbarriers (in 12 x 8
  // bytes) and the work tile's slot (48 bytes).
  const absl::StatusOr<ForwardPlan> hopper = PlanFlashForward(Params(DType::kBFloat16, 96), kH200);
  ASSERT_TRUE(hopper.ok()) << hopper.status();
  EXPECT_EQ(hopper->variant, ForwardVariant::kWgmmaSm90);
  EXPECT_EQ(hopper->kernel_head_dim, 128);
  EXPECT_EQ(hopper->smem_bytes, 1024 + (128 + 4 * 128 + 128) * 128 * 2 + 12 * 8 + 48);
  // At head dim 64: two Q tiles of 192 rows + 3 stages of K and V tiles of 128 rows + the O tile
  // of 192 rows, 64 bfloat16 each, 17 mbarriers (in 18 x 8 bytes) and two work tile slots.
  const absl::StatusOr<ForwardPlan> d64 = PlanFlashForward(Params(DType::kBFloat16, 64), kH200);
  ASSERT_TRUE(d64.ok()) << d64.status();
  EXPECT_EQ(d64->smem_bytes, 1024 + (2 * 192 + 6 * 128 + 192) * 64 * 2 + 18 * 8 + 2 * 48);
}

TEST(PlanFlashForwardTest, OnHopperFloat32FallsBackToTheMmaKernel) {
  SKIP_WITHOUT_SM90A();
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(Params(DType::kFloat32, 64), kH200);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->variant, ForwardVariant::kMmaSm80);
  const absl::StatusOr<ForwardPlan> forced =
      PlanFlashForward(Params(DType::kFloat32, 64), kH200, ForwardVariant::kWgmmaSm90);
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(forced.status(), "wgmma_sm90")) << forced.status();
  EXPECT_TRUE(Mentions(forced.status(), "float32")) << forced.status();
}

// float8 runs natively on Hopper for dense calls at head dims 128 and 256 (multiples of 16), with
// V^T's workspace; elsewhere the plan refuses it with INVALID_ARGUMENT, which HostRunner takes as
// "dequantise to bfloat16 first".
TEST(PlanFlashForwardTest, Float8RunsOnTheWgmmaKernelAtHeadDims128And256Dense) {
  SKIP_WITHOUT_SM90A();
  AttentionParams p = Params(DType::kFloat8E4M3, 128);
  p.batch = 3;
  p.heads_q = 8;
  p.heads_kv = 2;
  p.seqlen_q = 5;
  p.seqlen_k = 1000;  // V^T rows: 1008 keys
  const absl::StatusOr<ForwardPlan> plan = PlanFlashForward(p, kH200);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->variant, ForwardVariant::kWgmmaSm90);
  EXPECT_EQ(plan->dtype, DType::kFloat8E4M3);
  EXPECT_EQ(plan->workspace_bytes, 3 * 2 * 128 * 1008);
  p.head_dim = 240;
  EXPECT_EQ(PlanFlashForward(p, kH200)->kernel_head_dim, 256);
  for (int64_t head_dim : {64, 120, 8}) {  // D 64's tile, a row not of 16 bytes
    p.head_dim = head_dim;
    const absl::StatusOr<ForwardPlan> refused = PlanFlashForward(p, kH200);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << head_dim;
    EXPECT_TRUE(Mentions(refused.status(), "float8_e4m3")) << refused.status();
  }
  p.head_dim = 128;
  const int32_t cu[2] = {0, 5};
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  EXPECT_TRUE(Mentions(PlanFlashForward(p, kH200).status(), "varlen"));
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
  EXPECT_EQ(PlanFlashForward(p, kSm86).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlanFlashForwardTest, TheWgmmaKernelRunsOnComputeCapability90Only) {
  SKIP_WITHOUT_SM90A();
  const absl::StatusOr<ForwardPlan> plan =
      PlanFlashForward(Params(DType::kFloat16, 64), kSm86, ForwardVariant::kWgmmaSm90);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(plan.status(), "9.0")) << plan.status();
  EXPECT_TRUE(Mentions(plan.status(), "8.6")) << plan.status();
  // Every head dim the API takes fits Hopper's shared memory (D = 256: 80-key tiles).
  for (int64_t head_dim : {8, 64, 120, 128, 200, 256}) {
    const absl::StatusOr<ForwardPlan> fits =
        PlanFlashForward(Params(DType::kBFloat16, head_dim), kH200, ForwardVariant::kWgmmaSm90);
    EXPECT_TRUE(fits.ok()) << head_dim << ": " << fits.status();
  }
}

TEST(PlanFlashForwardTest, DeviceTooOldIsFailedPreconditionNamingTheVariant) {
  for (std::optional<ForwardVariant> forced :
       {std::optional<ForwardVariant>(), std::optional(ForwardVariant::kMmaSm80)}) {
    const absl::StatusOr<ForwardPlan> plan =
        PlanFlashForward(Params(DType::kFloat16, 64), kSm75, forced);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Mentions(plan.status(), "mma_sm80")) << plan.status();
    EXPECT_TRUE(Mentions(plan.status(), "7.5")) << plan.status();
  }
}

TEST(PlanFlashForwardTest, SharedMemoryBeyondTheDevicesIsFailedPrecondition) {
  // float32 at D = 256 takes 128 KiB per block, more than an sm_86 GPU allows; bfloat16 96 KiB.
  const absl::StatusOr<ForwardPlan> f32 = PlanFlashForward(Params(DType::kFloat32, 256), kSm86);
  EXPECT_EQ(f32.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(f32.status(), "shared memory")) << f32.status();
  EXPECT_TRUE(Mentions(f32.status(), "mma_sm80")) << f32.status();
  EXPECT_TRUE(PlanFlashForward(Params(DType::kBFloat16, 256), kSm86).ok());
  EXPECT_TRUE(PlanFlashForward(Params(DType::kFloat32, 256), kH200).ok());
}

TEST(PlanFlashForwardTest, HeadDimTheVariantLacksIsInvalidArgument) {
  for (int64_t head_dim : {12, 264}) {
    const absl::StatusOr<ForwardPlan> plan =
        PlanFlashForward(Params(DType::kFloat16, head_dim), kH200, ForwardVariant::kMmaSm80);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << head_dim;
    EXPECT_TRUE(Mentions(plan.status(), "mma_sm80")) << plan.status();
  }
}

TEST(PlanFlashForwardTest, UnknownForcedVariantIsInvalidArgument) {
  const absl::StatusOr<ForwardPlan> plan =
      PlanFlashForward(Params(DType::kFloat16, 64), kH200, static_cast<ForwardVariant>(99));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(plan.status(), "unknown forward variant")) << plan.status();
}

// A dense float8 call [B = 2, N, H, D] in BSHD: Nq = seqlen_q, Nk = 100, 4 query heads over 2; no
// tensors (the plan reads none).
AttentionParams Float8Call(int64_t head_dim, int64_t seqlen_q = 64) {
  AttentionParams p = Params(DType::kFloat8E4M3, head_dim);
  p.batch = 2;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = 100;
  p.SetContiguousStrides(Layout::kBSHD);
  return p;
}

TEST(PlanFloat8Test, HopperReadsE4m3ItselfAtHeadDims128And256) {
  SKIP_WITHOUT_SM90A();
  for (int64_t d : {128, 256}) {
    const AttentionParams p = Float8Call(d);
    const absl::StatusOr<Float8Path> path = PlanFloat8({p}, kH200);
    ASSERT_TRUE(path.ok()) << path.status();
    EXPECT_FALSE(path->dequantise) << d;
    // V transposed: [2 items, 2 kv heads, D, 100 keys rounded up to 16].
    EXPECT_EQ(path->workspace_bytes, TransposedVBytes(2, 2, d, 100)) << d;
  }
}

TEST(PlanFloat8Test, EveryOtherFloat8CallIsDequantisedToBfloat16) {
  auto dequantised = [](absl::Span<const AttentionParams> items, const DeviceCaps& caps,
                        std::optional<ForwardVariant> variant = std::nullopt) {
    const absl::StatusOr<Float8Path> path = PlanFloat8(items, caps, variant);
    EXPECT_TRUE(path.ok()) << path.status();
    return path.ok() && path->dequantise && path->workspace_bytes == 0;
  };
  EXPECT_TRUE(dequantised({Float8Call(64)}, kH200));   // a head dim the e4m3 wgmma lacks
  EXPECT_TRUE(dequantised({Float8Call(120)}, kH200));  // padded to 120: not a multiple of 16
  // Items of other lengths are packed as varlen, which the e4m3 path does not take.
  EXPECT_TRUE(dequantised({Float8Call(128), Float8Call(128, 32)}, kH200));
  EXPECT_TRUE(dequantised({Float8Call(128)}, kSm86));  // no wgmma before Hopper
  EXPECT_TRUE(dequantised({Float8Call(128)}, kH200, ForwardVariant::kMmaSm80));
  // The kernels' options instances are 16-bit only.
  AttentionParams capped = Float8Call(128);
  capped.softcap = 30.0f;
  EXPECT_TRUE(dequantised({capped}, kH200));
  AttentionParams chunked = Float8Call(256);
  chunked.chunk_size = 64;
  EXPECT_TRUE(dequantised({chunked}, kH200));
  const absl::StatusOr<ForwardPlan> refused =
      PlanFlashForward(capped, kH200, ForwardVariant::kWgmmaSm90);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_TRUE(Mentions(refused.status(), "softcap")) << refused.status();
}

TEST(PlanFloat8Test, OtherDtypesTakeNoFloat8Path) {
  AttentionParams p = Float8Call(128);
  p.dtype = DType::kBFloat16;
  const absl::StatusOr<Float8Path> path = PlanFloat8({p}, kH200);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_FALSE(path->dequantise);
  EXPECT_EQ(path->workspace_bytes, 0);
}

TEST(CudaStatusTest, AllocationFailureIsResourceExhaustedOthersInternal) {
  const absl::Status oom = CudaError(cudaErrorMemoryAllocation, "cannot allocate 64 bytes");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(oom, "cudaErrorMemoryAllocation")) << oom;
  EXPECT_TRUE(Mentions(oom, "cannot allocate 64 bytes")) << oom;
  const absl::Status launch = CudaError(cudaErrorLaunchFailure, "forward kernel");
  EXPECT_EQ(launch.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Mentions(launch, "cudaErrorLaunchFailure")) << launch;
  EXPECT_TRUE(CudaStatus(cudaSuccess, "nothing").ok());
  EXPECT_EQ(CudaStatus(cudaErrorInvalidValue, "x").code(), absl::StatusCode::kInternal);
}

// Every position of a launch names a distinct work tile and every tile has one: a tile mapped
// twice would be computed twice and one never mapped left unwritten, so this is the Hopper
// kernel's coverage of O. Within a group of pairs the query tiles come heaviest first.
TEST(Sm90ScheduleTest, PositionsCoverEveryWorkTileOnceHeaviestFirstInAGroup) {
  struct Launch {
    int seqlen_q, tile_rows, heads_q, batch;
    bool masked;
  };
  for (const Launch& l : {Launch{1024, 128, 16, 16, true}, Launch{4096, 192, 32, 4, true},
                          Launch{1000, 128, 3, 7, true}, Launch{129, 128, 5, 1, true},
                          Launch{4096, 128, 16, 4, false}, Launch{1, 128, 1, 1, true}}) {
    const Sm90Schedule sc = MakeSm90Schedule(l.seqlen_q, l.tile_rows, l.heads_q, l.batch, l.masked);
    SCOPED_TRACE(::testing::Message() << "seqlen_q " << l.seqlen_q << " heads " << l.heads_q
                                      << " batch " << l.batch << " masked " << l.masked);
    ASSERT_EQ(sc.m_blocks, (l.seqlen_q + l.tile_rows - 1) / l.tile_rows);
    ASSERT_EQ(sc.work_tiles, sc.m_blocks * l.heads_q * l.batch);
    EXPECT_EQ(sc.group, std::min(l.masked ? 8 : 1, l.heads_q * l.batch));
    std::vector<int> seen(sc.work_tiles, 0);
    int last_group = -1, last_m_block = 0;
    for (int pos = 0; pos < sc.work_tiles; ++pos) {
      const Sm90TileCoords at = Sm90TileAt(sc, pos);
      ASSERT_GE(at.m_block, 0);
      ASSERT_LT(at.m_block, sc.m_blocks);
      ASSERT_GE(at.pair, 0);
      ASSERT_LT(at.pair, sc.pairs);
      ++seen[at.pair * sc.m_blocks + at.m_block];
      const int group = at.pair / sc.group;
      if (group == last_group) EXPECT_LE(at.m_block, last_m_block) << "position " << pos;
      last_group = group;
      last_m_block = at.m_block;
    }
    for (int tile = 0; tile < sc.work_tiles; ++tile) EXPECT_EQ(seen[tile], 1) << "tile " << tile;
  }
}

TEST(SpecialisedHeadDimsTest, AscendingEndingAtTheLimits) {
  const std::vector<int> forward = SpecialisedHeadDims();
  ASSERT_FALSE(forward.empty());
  EXPECT_TRUE(std::is_sorted(forward.begin(), forward.end()));
  EXPECT_EQ(forward.back(), kMaxHeadDim);
  const std::vector<int> paged = PagedSpecialisedHeadDims();
  ASSERT_FALSE(paged.empty());
  EXPECT_TRUE(std::is_sorted(paged.begin(), paged.end()));
  EXPECT_LE(paged.back(), kPagedMaxHeadDim);
}

// A paged decode step of one sequence (one query, 300 keys) of `dtype` and head dim `d` with Hq =
// 8, Hkv = 2, planned for an H200 (host arrays only: PlanPagedDecode reads no device memory).
struct PagedStep {
  int32_t cu_q[2] = {0, 1};
  int32_t seqlens_k[1] = {300};
  float sinks[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  PagedDecodeParams p;
  DecodeExtent extent{.page_rows = 64, .max_seqlen_q = 1, .max_seqlen_k = 300};

  PagedStep(DType dtype, int64_t d) {
    p.shape = {dtype, 2, d};
    p.heads_q = 8;
    p.num_seqs = 1;
    p.cu_seqlens_q = cu_q;
    p.total_q = 1;
    p.max_seqlen_q = 1;
    p.seqlens_k = seqlens_k;
    p.max_seqlen_k = 300;
  }
  PagedDecodePlan Plan() const {
    const absl::StatusOr<PagedDecodePlan> plan =
        PlanPagedDecode(p, extent, {.sm_count = 132, .clusters = true});
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.value_or(PagedDecodePlan{});
  }
};

// A softcapped step runs on the one tile instantiated with the softcap (kPagedSoftcapHeadDim),
// whatever head dim a tensor-core tile holds; plain steps keep their own tile; float32 and head
// dims no tile holds run on the SIMT kernel, which caps by a branch. Sinks and chunks take no
// kernel of their own.
TEST(PlanPagedDecodeTest, SoftcapRunsOnTheSoftcapTileOthersOnTheirOwn) {
  struct Case {
    DType dtype;
    int64_t d;
    float softcap;
    int kernel_head_dim;
    bool softcap_kernel;
  };
  for (const Case& c :
       {Case{DType::kBFloat16, 64, 0.0f, 64, false},
        Case{DType::kBFloat16, 64, 30.0f, kPagedSoftcapHeadDim, true},
        Case{DType::kFloat16, 40, 50.0f, kPagedSoftcapHeadDim, true},
        Case{DType::kFloat16, 128, 0.0f, 128, false}, Case{DType::kBFloat16, 128, 50.0f, 128, true},
        Case{DType::kBFloat16, 256, 50.0f, 0, false}, Case{DType::kFloat32, 64, 30.0f, 0, false},
        Case{DType::kFloat16, 20, 30.0f, 0, false}}) {
    SCOPED_TRACE(testing::Message()
                 << DTypeName(c.dtype) << " D=" << c.d << " softcap=" << c.softcap);
    PagedStep step(c.dtype, c.d);
    step.p.softcap = c.softcap;
    step.p.sinks = step.sinks;
    step.p.chunk_size = 32;
    const PagedDecodePlan plan = step.Plan();
    EXPECT_EQ(plan.launch.kernel_head_dim, c.kernel_head_dim);
    EXPECT_EQ(plan.launch.softcap, c.softcap_kernel);
    // The key tile is the chosen kernel's (64 keys at D = 128 and on the SIMT kernel, 128 at 64).
    EXPECT_EQ(plan.key_tile, c.kernel_head_dim == 64 ? 128 : 64);
  }
}

// (D, Dv) = (576, 512) (MLA's absorbed decode) and (512, 512) of float16 and bfloat16 run on the
// wide tile where the device's blocks may opt in to its shared memory (an H200's 227 KiB; not an
// A100's 163), in CTAs of kPagedWideRows rows and tiles of 32 keys, one CTA per SM; a softcap,
// float32, other V head dims and smaller devices take the SIMT kernel, its wide instance past
// head dim 256. V in K's rows (v_from_k) runs on the wide tile's instance for it at (576, 512),
// whose three stages of K alone fit the same devices, and on the SIMT kernel elsewhere, the
// D = 128 tile included. The kernel params carry Dv and v_from_k.
TEST(PlanPagedDecodeTest, WideTileServesMlaAndD512WhereItsSharedMemoryFits) {
  struct Case {
    DType dtype;
    int64_t d, dv;
    float softcap;
    int smem_per_block;
    int wide_head_dim;
    bool simt_wide;
    bool v_from_k = false;
  };
  constexpr int kH200 = 232448, kA100 = 166912;
  for (const Case& c : {Case{DType::kBFloat16, 576, 512, 0.0f, kH200, 576, false},
                        Case{DType::kFloat16, 576, 512, 0.0f, kH200, 576, false},
                        Case{DType::kBFloat16, 512, 512, 0.0f, kH200, 512, false},
                        Case{DType::kBFloat16, 576, 512, 0.0f, kA100, 0, true},
                        Case{DType::kBFloat16, 576, 512, 0.0f, 0, 0, true},
                        Case{DType::kBFloat16, 576, 512, 30.0f, kH200, 0, true},
                        Case{DType::kFloat32, 576, 512, 0.0f, kH200, 0, true},
                        Case{DType::kBFloat16, 576, 576, 0.0f, kH200, 0, true},
                        Case{DType::kBFloat16, 192, 128, 0.0f, kH200, 0, false},
                        Case{DType::kBFloat16, 64, 128, 0.0f, kH200, 0, false},
                        Case{DType::kBFloat16, 576, 512, 0.0f, kH200, 576, false, true},
                        Case{DType::kFloat16, 576, 512, 0.0f, kH200, 576, false, true},
                        Case{DType::kBFloat16, 576, 512, 0.0f, kA100, 0, true, true},
                        Case{DType::kBFloat16, 512, 512, 0.0f, kH200, 0, true, true},
                        Case{DType::kBFloat16, 128, 128, 0.0f, kH200, 0, false, true}}) {
    SCOPED_TRACE(testing::Message()
                 << DTypeName(c.dtype) << " D=" << c.d << " Dv=" << c.dv << " softcap=" << c.softcap
                 << " smem=" << c.smem_per_block << " v_from_k=" << c.v_from_k);
    PagedStep step(c.dtype, c.d);
    step.p.shape = {c.dtype, 1, c.d, c.dv, c.v_from_k};
    step.p.heads_q = 128;
    step.p.softcap = c.softcap;
    const absl::StatusOr<PagedDecodePlan> plan =
        PlanPagedDecode(step.p, step.extent,
                        {.sm_count = 132, .clusters = true, .smem_per_block = c.smem_per_block});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->launch.wide_head_dim, c.wide_head_dim);
    EXPECT_EQ(plan->launch.wide_v_from_k, c.v_from_k && c.wide_head_dim != 0);
    EXPECT_EQ(plan->launch.kernel_head_dim, 0);
    EXPECT_EQ(plan->launch.simt_wide, c.simt_wide);
    const bool wide = c.wide_head_dim != 0;
    EXPECT_EQ(plan->m_blocks, wide ? 128 / kPagedWideRows : 128 / 16);
    EXPECT_EQ(plan->key_tile, wide ? 32 : 64);
    EXPECT_FALSE(plan->cluster);
    const PagedKernelParams k =
        ToPagedKernelParams(*plan, nullptr, 1 << 20, step.extent, step.p, nullptr, nullptr);
    EXPECT_EQ(std::pair(k.head_dim, k.v_head_dim),
              std::pair(static_cast<int>(c.d), static_cast<int>(c.dv)));
    EXPECT_EQ(k.v_from_k, c.v_from_k);
  }
  // Past the SIMT kernel's 576 columns: INVALID_ARGUMENT naming both head dims.
  PagedStep step(DType::kBFloat16, 640);
  const absl::StatusOr<PagedDecodePlan> refused =
      PlanPagedDecode(step.p, step.extent, {.sm_count = 132});
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "head_dim 640 / v_head_dim 640"))
      << refused.status();
}

// The wide tile's splits stop where the merge of their partial o (up to 64 rows x Dv floats each,
// read by one CTA) would read four times a split's own K/V, S^2 <= 2 NK (D + Dv) / (R Dv) with R
// the block's live rows (whole key tiles per split): MLA at batch 1 takes 16 splits over 4096 keys
// (64 rows, Hq 128) and 32 at Hq 16 (16 live rows), 45 and 86 over 32768 keys, where filling the
// SMs alone gave 64-128. Where the fill asks fewer (MLA at batch 8, D = 512 with its 8 live rows)
// it is kept: the splits of the unchanged planner, 8 and 32.
TEST(PlanPagedDecodeTest, WideTileSplitsStopWhereTheirMergeWouldOutlastThem) {
  struct Case {
    int64_t d, heads_kv, heads_q, batch, nk;
    int splits;
  };
  for (const Case& c : {Case{576, 1, 128, 1, 4096, 16}, Case{576, 1, 16, 1, 4096, 32},
                        Case{576, 1, 128, 1, 32768, 45}, Case{576, 1, 16, 1, 32768, 86},
                        Case{576, 1, 128, 8, 4096, 8}, Case{512, 4, 32, 1, 4096, 32}}) {
    SCOPED_TRACE(testing::Message()
                 << "D=" << c.d << " Hq=" << c.heads_q << " B=" << c.batch << " NK=" << c.nk);
    PagedStep step(DType::kBFloat16, c.d);
    step.p.shape = {DType::kBFloat16, c.heads_kv, c.d, 512};
    step.p.heads_q = c.heads_q;
    step.p.num_seqs = c.batch;
    step.p.total_q = c.batch;
    step.extent.max_seqlen_k = c.nk;
    const absl::StatusOr<PagedDecodePlan> plan =
        PlanPagedDecode(step.p, step.extent, {.sm_count = 132, .smem_per_block = 232448});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->launch.wide_head_dim, c.d);
    EXPECT_EQ(plan->splits, c.splits);
  }
}

// The kernel params carry the options as the kernels take them: the sinks' device pointer, the
// softcap in the log2 domain with the scale of q.k to s / softcap (|softmax_scale|: a negative
// scale negates q), and the chunk size clamped to 2^30; absent options are 0 / null.
TEST(PagedKernelParamsTest, OptionsReachTheKernelParams) {
  PagedStep step(DType::kBFloat16, 128);
  step.p.softmax_scale = -0.125f;
  const PagedDecodePlan plain_plan = step.Plan();
  const PagedKernelParams plain =
      ToPagedKernelParams(plain_plan, nullptr, 1 << 20, step.extent, step.p, nullptr, nullptr);
  EXPECT_EQ(plain.sinks, nullptr);
  EXPECT_EQ(plain.softcap_log2, 0.0f);
  EXPECT_EQ(plain.chunk_size, 0);
  EXPECT_TRUE(plain.negate_q);

  step.p.sinks = step.sinks;  // stands for the pool's device copy
  step.p.softcap = 30.0f;
  step.p.chunk_size = 48;
  const PagedDecodePlan plan = step.Plan();
  PagedKernelParams k =
      ToPagedKernelParams(plan, nullptr, 1 << 20, step.extent, step.p, nullptr, nullptr);
  EXPECT_EQ(k.sinks, step.sinks);
  EXPECT_FLOAT_EQ(k.softcap_log2, 30.0f * 1.4426950408889634f);
  EXPECT_FLOAT_EQ(k.softcap_scale, 0.125f / 30.0f);
  EXPECT_TRUE(k.negate_q);
  EXPECT_EQ(k.chunk_size, 48);
  // A chunk of 2^30 keys or more sees as any larger one does (lengths stay below 2^30).
  step.p.chunk_size = int64_t{1} << 40;
  k = ToPagedKernelParams(plan, nullptr, 1 << 20, step.extent, step.p, nullptr, nullptr);
  EXPECT_EQ(k.chunk_size, 1 << 30);
}

// The Hopper kernel builds each wgmma k-step's descriptor as its tile's first moved on by the
// step's byte offset (DescPlus): it must equal the descriptor built at the moved address, for
// every 16-byte-aligned shared address and offset that stay in the 227 KiB a CTA can have (the
// kernel's k-step offsets are under 64 KiB). Past 2^18 the field would carry, and the two differ.
TEST(SmemDescTest, MovedOnDescriptorEqualsTheOneBuiltThere) {
  constexpr uint32_t kSmem = 232448;  // H200's opt-in limit per block
  int64_t checked = 0;
  for (uint32_t addr = 0; addr < kSmem; addr += 16) {
    for (uint32_t offset = 0; offset < 65536 && addr + offset < kSmem; offset += 16) {
      for (uint32_t lbo : {16u, 128u * 80u, 128u * 128u}) {
        const uint64_t built = SmemDesc128B(addr + offset, lbo, 1024);
        const uint64_t moved = DescPlus(SmemDesc128B(addr, lbo, 1024), offset >> 4);
        if (built != moved) {
          FAIL() << "addr " << addr << " offset " << offset << " lbo " << lbo << ": built " << built
                 << ", moved on " << moved;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100000000);
  // The bound is real: across 2^18 the address field wraps in the built descriptor but carries
  // into the next field in the moved one.
  EXPECT_NE(SmemDesc128B((1u << 18) - 16 + 32, 16, 1024),
            DescPlus(SmemDesc128B((1u << 18) - 16, 16, 1024), 2));
}

}  // namespace
}  // namespace attention::cuda
