// The CUDA host runner's launch decisions (kernels/cuda/runtime/launch_plan.h) without a GPU: which
// items scan V and where, packing, in place or copied, staged or direct and in which order, lse's
// way back. Tensor pointers are addresses that are never dereferenced (the plan reads only their
// values, for alignment); cu_seqlens are real host arrays.
#include "kernels/cuda/runtime/launch_plan.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention_params.h"

namespace attention::cuda {
namespace {

// An address on 256 bytes (plus `offset`), never dereferenced.
void* Address(uintptr_t n, uintptr_t offset = 0) {
  return reinterpret_cast<void*>((n << 20) + offset);
}

// Dense [B, H, N, D] (BHSD) or [B, N, H, D] (BSHD) q, k, v, o at distinct addresses.
AttentionParams Dense(int64_t batch, int64_t nq, int64_t nk, int64_t head_dim,
                      Layout layout = Layout::kBSHD, DType dtype = DType::kFloat16) {
  AttentionParams p;
  p.dtype = dtype;
  p.batch = batch;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.seqlen_q = nq;
  p.seqlen_k = nk;
  p.head_dim = head_dim;
  p.q = Address(1);
  p.k = Address(2);
  p.v = Address(3);
  p.o = Address(4);
  p.SetContiguousStrides(layout);
  return p;
}

// Varlen [total, H, D] over the given offsets (kept alive by the caller).
AttentionParams Varlen(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                       int64_t head_dim) {
  AttentionParams p = Dense(static_cast<int64_t>(cu_q.size()) - 1, 0, 0, head_dim);
  p.cu_seqlens_q = cu_q.data();
  p.cu_seqlens_k = cu_k.data();
  p.total_q = cu_q.back();
  p.total_k = cu_k.back();
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    p.seqlen_q = std::max<int64_t>(p.seqlen_q, cu_q[b + 1] - cu_q[b]);
    p.seqlen_k = std::max<int64_t>(p.seqlen_k, cu_k[b + 1] - cu_k[b]);
  }
  p.SetContiguousStrides(Layout::kBSHD);
  return p;
}

TensorHomes AllAt(Home home) { return {home, home, home, home, home}; }

TEST(CanShareLaunchTest, DenseOfEqualLengthsOrPackableRows) {
  const AttentionParams a = Dense(2, 64, 128, 64), b = Dense(3, 64, 128, 64);
  EXPECT_TRUE(CanShareLaunch(a, b));
  // BSHD of other lengths pack as varlen rows; BHSD of other lengths cannot.
  EXPECT_TRUE(CanShareLaunch(a, Dense(1, 32, 128, 64)));
  EXPECT_FALSE(
      CanShareLaunch(Dense(2, 64, 128, 64, Layout::kBHSD), Dense(2, 32, 128, 64, Layout::kBHSD)));
  EXPECT_FALSE(CanShareLaunch(a, Dense(2, 64, 128, 64, Layout::kBHSD)));
  EXPECT_FALSE(CanShareLaunch(a, Dense(2, 64, 128, 128)));
  AttentionParams causal = b;
  causal.window_right = 0;
  EXPECT_FALSE(CanShareLaunch(a, causal));
}

TEST(CanShareLaunchTest, ARequestWithOptionsRunsAloneAndSharesWithNoOther) {
  const float sinks[4] = {0.5f, -1.0f, 2.0f, 0.0f};
  AttentionParams with_sinks = Dense(1, 97, 97, 64), with_softcap = with_sinks,
                  with_chunks = with_sinks;
  with_sinks.sinks = sinks;
  with_softcap.softcap = 30.0f;
  with_chunks.chunk_size = 16;
  const AttentionParams plain = Dense(1, 97, 97, 64);
  for (const AttentionParams& p : {with_sinks, with_softcap, with_chunks}) {
    // Alone, it is one launch (RunBatch of a single request).
    EXPECT_TRUE(IsOneLaunch(std::vector<AttentionParams>{p}));
    // With any other request, even one with the same options, it is not.
    EXPECT_FALSE(CanShareLaunch(p, plain));
    EXPECT_FALSE(CanShareLaunch(plain, p));
    EXPECT_FALSE(IsOneLaunch(std::vector<AttentionParams>{p, p}));
    EXPECT_FALSE(IsOneLaunch(std::vector<AttentionParams>{p, plain}));
    EXPECT_FALSE(IsOneLaunch(std::vector<AttentionParams>{plain, p}));
  }
  EXPECT_TRUE(IsOneLaunch(std::vector<AttentionParams>{plain}));
  EXPECT_TRUE(IsOneLaunch(std::vector<AttentionParams>{plain, Dense(2, 97, 97, 64)}));
  EXPECT_FALSE(IsOneLaunch(std::vector<AttentionParams>{plain, Dense(2, 97, 97, 128)}));
}

TEST(PlanVScanTest, UnmaskedScansNothingMaskedScansWhereVIs) {
  AttentionParams p = Dense(1, 16, 16, 64);
  const std::vector<AttentionParams> items = {p, p};
  const std::vector<TensorHomes> homes = {AllAt(Home::kPageable), AllAt(Home::kDevice)};
  EXPECT_EQ(PlanVScan(items, homes), (std::vector<VScan>{VScan::kNone, VScan::kNone}));
  p.window_right = 0;  // causal
  const std::vector<AttentionParams> masked = {p, p};
  std::vector<TensorHomes> pinned_v = {AllAt(Home::kDevice), AllAt(Home::kDevice)};
  pinned_v[0].v = Home::kPinned;
  EXPECT_EQ(PlanVScan(masked, pinned_v), (std::vector<VScan>{VScan::kHost, VScan::kDevice}));
  p.window_right = kUnboundedWindow;
  p.window_left = 8;  // a window on one side masks too
  EXPECT_EQ(PlanVScan(std::vector<AttentionParams>{p}, std::vector<TensorHomes>{homes[0]}),
            std::vector<VScan>{VScan::kHost});
  p.window_left = kUnboundedWindow;
  p.chunk_size = 5;  // and so do chunks
  EXPECT_EQ(PlanVScan(std::vector<AttentionParams>{p}, std::vector<TensorHomes>{homes[1]}),
            std::vector<VScan>{VScan::kDevice});
}

TEST(PlanLaunchTest, EqualDenseItemsAreConcatenatedAlongB) {
  const std::vector<AttentionParams> items = {Dense(2, 64, 96, 64, Layout::kBHSD),
                                              Dense(3, 64, 96, 64, Layout::kBHSD)};
  const std::vector<TensorHomes> homes(2, AllAt(Home::kPageable));
  const LaunchPlan plan = PlanLaunch(items, homes, {});
  EXPECT_FALSE(plan.device.varlen);
  EXPECT_EQ(plan.device.sequences, 5);
  EXPECT_EQ(plan.layout, Layout::kBHSD);
  EXPECT_EQ(plan.seqlen_q, 64);
  EXPECT_EQ(plan.seqlen_k, 96);
  EXPECT_TRUE(plan.cu_seqlens_q.empty());
  EXPECT_EQ(plan.device.line_q, (std::vector<int64_t>{0, 2 * 64 * 4}));
  EXPECT_EQ(plan.device.line_k, (std::vector<int64_t>{0, 2 * 96 * 2}));
  EXPECT_EQ(plan.device.lines_q, 5 * 64 * 4);
  // q | k | v | o, fp16 lines of 64, 256-byte aligned regions; no lse, cu_seqlens or float8.
  const int64_t q = 5 * 64 * 4 * 64 * 2, k = 5 * 96 * 2 * 64 * 2;
  EXPECT_EQ(plan.device_bytes, q + k + k + q);
  EXPECT_EQ(plan.staging_bytes, plan.device_bytes);
  EXPECT_FALSE(plan.in_place);
  EXPECT_TRUE(plan.reserve_buffers);
}

TEST(PlanLaunchTest, OtherLengthsArePackedAsVarlenWithCuSeqlens) {
  const std::vector<int32_t> cu_q = {0, 5, 12}, cu_k = {0, 7, 20};
  const std::vector<AttentionParams> items = {Dense(2, 3, 4, 64), Varlen(cu_q, cu_k, 64)};
  const std::vector<TensorHomes> homes(2, AllAt(Home::kPageable));
  const LaunchPlan plan = PlanLaunch(items, homes, {});
  EXPECT_TRUE(plan.device.varlen);
  EXPECT_EQ(plan.device.sequences, 4);
  EXPECT_EQ(plan.layout, Layout::kBSHD);
  EXPECT_EQ(plan.cu_seqlens_q, (std::vector<int32_t>{0, 3, 6, 11, 18}));
  EXPECT_EQ(plan.cu_seqlens_k, (std::vector<int32_t>{0, 4, 8, 15, 28}));
  EXPECT_EQ(plan.seqlen_q, 7);
  EXPECT_EQ(plan.seqlen_k, 13);
  EXPECT_EQ(plan.total_k, 28);
  EXPECT_EQ(plan.device.rows_q, 18);
  EXPECT_EQ(plan.device.row_q, (std::vector<int64_t>{0, 6}));
  EXPECT_GT(plan.device.offsets[Packing::kCuK + 1], plan.device.offsets[Packing::kCuK]);
}

TEST(PlanLaunchTest, HeadDimsOffEightArePaddedOnTheDeviceOnly) {
  const std::vector<AttentionParams> items = {Dense(1, 16, 16, 100)};
  const std::vector<TensorHomes> homes = {AllAt(Home::kDevice)};
  const LaunchPlan plan = PlanLaunch(items, homes, {});
  EXPECT_EQ(plan.head_dim, 100);
  EXPECT_EQ(plan.padded_head_dim, 104);
  EXPECT_EQ(plan.device.offsets[Packing::kK], 16 * 4 * 104 * 2);
  EXPECT_EQ(plan.staging.offsets[Packing::kK], 16 * 4 * 100 * 2);  // a multiple of 256
  // Padding needs a copy, even with every tensor on the device.
  EXPECT_FALSE(plan.in_place);
  EXPECT_TRUE(plan.copies_to_device);
}

TEST(PlanLaunchTest, ALoneAlignedDenseRequestOnTheDeviceRunsInPlace) {
  AttentionParams p = Dense(1, 64, 64, 128);
  const std::vector<TensorHomes> on_device = {AllAt(Home::kDevice)};
  LaunchPlan plan = PlanLaunch({p}, on_device, {});
  EXPECT_TRUE(plan.in_place);
  EXPECT_FALSE(plan.reserve_buffers);  // nothing for the stream's buffers to hold
  EXPECT_TRUE(plan.copies_in.empty());
  EXPECT_TRUE(plan.copies_out.empty());
  EXPECT_FALSE(plan.copies_to_device);
  EXPECT_FALSE(plan.copies_to_host);

  // Its lse on the device is written in place too; on the host it goes through staging.
  p.lse = static_cast<float*>(Address(5));
  plan = PlanLaunch({p}, on_device, {});
  EXPECT_TRUE(plan.lse_in_place);
  EXPECT_FALSE(plan.reserve_buffers);
  std::vector<TensorHomes> lse_on_host = on_device;
  lse_on_host[0].lse = Home::kPageable;
  plan = PlanLaunch({p}, lse_on_host, {});
  EXPECT_TRUE(plan.in_place);
  EXPECT_FALSE(plan.lse_in_place);
  EXPECT_TRUE(plan.lse_to_host);
  EXPECT_TRUE(plan.reserve_buffers);
  EXPECT_FALSE(plan.copies_to_device);
  EXPECT_TRUE(plan.copies_to_host);

  // float8 dequantised in place still needs the bfloat16 copies' buffer.
  AttentionParams f8 = Dense(1, 64, 64, 128, Layout::kBSHD, DType::kFloat8E4M3);
  plan = PlanLaunch({f8}, on_device, {.dequantise = true});
  EXPECT_TRUE(plan.in_place);
  EXPECT_TRUE(plan.reserve_buffers);
  EXPECT_EQ(plan.device.offsets[Packing::kK16] - plan.device.offsets[Packing::kQ16],
            64 * 4 * 128 * 2);
}

TEST(PlanLaunchTest, NotInPlaceWhenMisalignedElsewhereOrBatched) {
  AttentionParams p = Dense(1, 64, 64, 128);
  const std::vector<TensorHomes> on_device = {AllAt(Home::kDevice)};
  AttentionParams misaligned = p;
  misaligned.k = Address(2, 8);  // on 8 bytes, not 16
  EXPECT_FALSE(PlanLaunch({misaligned}, on_device, {}).in_place);
  std::vector<TensorHomes> o_pinned = on_device;
  o_pinned[0].o = Home::kPinned;
  EXPECT_FALSE(PlanLaunch({p}, o_pinned, {}).in_place);
  const std::vector<TensorHomes> two(2, AllAt(Home::kDevice));
  EXPECT_FALSE(PlanLaunch({p, p}, two, {}).in_place);
  std::vector<int32_t> cu = {0, 64};
  EXPECT_FALSE(PlanLaunch({Varlen(cu, cu, 128)}, on_device, {}).in_place);
}

TEST(PlanLaunchTest, ConsecutiveStagedItemsShareOneDmaAndDirectOnesGoAlone) {
  // q: pageable, pageable, pinned, pageable; k and v on the device; o: pinned, pageable, pageable,
  // device.
  const AttentionParams p = Dense(1, 8, 8, 64);
  const std::vector<AttentionParams> items(4, p);
  std::vector<TensorHomes> homes(4, AllAt(Home::kDevice));
  homes[0].q = homes[1].q = homes[3].q = Home::kPageable;
  homes[2].q = Home::kPinned;
  homes[0].o = Home::kPinned;
  homes[1].o = homes[2].o = Home::kPageable;
  const LaunchPlan plan = PlanLaunch(items, homes, {});
  const int64_t lq = 8 * 4, lk = 8 * 2;  // lines per item
  using S = CopyStep;
  const std::vector<CopyStep> in = {
      {S::kStage, Packing::kQ, 0, 0, lq},         {S::kStage, Packing::kQ, 1, lq, lq},
      {S::kStagedRun, Packing::kQ, 0, 0, 2 * lq}, {S::kDirect, Packing::kQ, 2, 2 * lq, lq},
      {S::kStage, Packing::kQ, 3, 3 * lq, lq},    {S::kStagedRun, Packing::kQ, 0, 3 * lq, lq},
      {S::kDirect, Packing::kK, 0, 0, lk},        {S::kDirect, Packing::kK, 1, lk, lk},
      {S::kDirect, Packing::kK, 2, 2 * lk, lk},   {S::kDirect, Packing::kK, 3, 3 * lk, lk},
      {S::kDirect, Packing::kV, 0, 0, lk},        {S::kDirect, Packing::kV, 1, lk, lk},
      {S::kDirect, Packing::kV, 2, 2 * lk, lk},   {S::kDirect, Packing::kV, 3, 3 * lk, lk},
  };
  EXPECT_EQ(plan.copies_in, in);
  const std::vector<CopyStep> out = {
      {S::kDirect, Packing::kO, 0, 0, lq},
      {S::kStagedRun, Packing::kO, 0, lq, 2 * lq},
      {S::kDirect, Packing::kO, 3, 3 * lq, lq},
  };
  EXPECT_EQ(plan.copies_out, out);
  EXPECT_EQ(plan.o_staged, (std::vector<bool>{false, true, true, false}));
  EXPECT_TRUE(plan.copies_to_device);
  EXPECT_TRUE(plan.copies_to_host);
}

TEST(PlanLaunchTest, LseGoesToTheHostUnlessEveryItemsIsOnTheDevice) {
  AttentionParams p = Dense(1, 8, 8, 64);
  p.lse = static_cast<float*>(Address(5));
  std::vector<TensorHomes> homes(2, AllAt(Home::kPageable));
  homes[1].lse = Home::kDevice;
  LaunchPlan plan = PlanLaunch({p, p}, homes, {});
  EXPECT_EQ(plan.lse_on_device, (std::vector<bool>{false, true}));
  EXPECT_TRUE(plan.lse_to_host);
  homes[0].lse = Home::kDevice;
  plan = PlanLaunch({p, p}, homes, {});
  EXPECT_FALSE(plan.lse_to_host);
}

TEST(LaunchParamsTest, VarlenPackTakesTheDeviceRegionsAndD8) {
  const std::vector<int32_t> cu_q = {0, 5}, cu_k = {0, 9};
  const std::vector<AttentionParams> items = {Dense(1, 3, 4, 100), Varlen(cu_q, cu_k, 100)};
  const std::vector<TensorHomes> homes(2, AllAt(Home::kPageable));
  const LaunchPlan plan = PlanLaunch(items, homes, {});
  char* const base = static_cast<char*>(Address(7));
  const AttentionParams launch = LaunchParams(plan, items[0], base);
  EXPECT_EQ(launch.head_dim, 104);
  EXPECT_EQ(launch.batch, 2);
  EXPECT_TRUE(launch.is_varlen());
  EXPECT_EQ(launch.cu_seqlens_k,
            reinterpret_cast<const int32_t*>(base + plan.device.offsets[Packing::kCuK]));
  EXPECT_EQ(launch.q, base);
  EXPECT_EQ(launch.o, base + plan.device.offsets[Packing::kO]);
  EXPECT_EQ(launch.lse, nullptr);
  EXPECT_EQ(launch.total_q, 8);
  EXPECT_EQ(launch.total_k, 13);
  EXPECT_EQ(launch.seqlen_q, 5);
  EXPECT_EQ(launch.seqlen_k, 9);
  EXPECT_EQ(launch.q_row_stride, 4 * 104);  // [total, H, D8] rows
  // Without a buffer yet, the regions are null.
  EXPECT_EQ(LaunchParams(plan, items[0], nullptr).q, nullptr);
}

TEST(LaunchParamsTest, InPlaceUsesTheItemsTensorsAndDequantisedFloat8ItsCopies) {
  AttentionParams p = Dense(2, 16, 16, 128, Layout::kBHSD, DType::kFloat8E4M3);
  p.lse = static_cast<float*>(Address(5));
  const std::vector<TensorHomes> on_device = {AllAt(Home::kDevice)};
  char* const base = static_cast<char*>(Address(7));
  LaunchPlan plan = PlanLaunch({p}, on_device, {});
  AttentionParams launch = LaunchParams(plan, p, base);
  EXPECT_EQ(launch.q, p.q);
  EXPECT_EQ(launch.o, p.o);
  EXPECT_EQ(launch.lse, p.lse);
  EXPECT_EQ(launch.dtype, DType::kFloat8E4M3);
  EXPECT_EQ(launch.q_head_stride, 16 * 128);  // BHSD kept
  plan = PlanLaunch({p}, on_device, {.dequantise = true});
  launch = LaunchParams(plan, p, base);
  EXPECT_EQ(launch.dtype, DType::kBFloat16);
  EXPECT_EQ(launch.q, base + plan.device.offsets[Packing::kQ16]);
  EXPECT_EQ(launch.v, base + plan.device.offsets[Packing::kV16]);
  EXPECT_EQ(launch.o, p.o);  // written in place, in bfloat16
  EXPECT_EQ(launch.q_descale, p.q_descale);
}

TEST(ForEachLsePieceTest, DenseItemsOfAVarlenPackAreCutPerSequence) {
  // A dense item (B = 2, N = 3, H = 4) after a varlen one of 5 rows: packed lse is [H, 11 rows].
  const std::vector<int32_t> cu = {0, 5};
  AttentionParams dense = Dense(2, 3, 3, 64);
  float* const base = static_cast<float*>(Address(6));
  dense.lse = base;
  const std::vector<AttentionParams> items = {Varlen(cu, cu, 64), dense};
  const Packing pack = Pack(items);
  ASSERT_TRUE(pack.varlen);
  struct Piece {
    int64_t dst, dst_pitch, src, src_pitch, width, height;
    bool operator==(const Piece&) const = default;
  };
  std::vector<Piece> pieces;
  ForEachLsePiece(items[1], pack, 1,
                  [&](float* dst, int64_t dst_pitch, int64_t src, int64_t src_pitch, int64_t width,
                      int64_t height) {
                    pieces.push_back({dst - base, dst_pitch, src, src_pitch, width, height});
                  });
  // Sequence b's [H, N] block of the item's [B, H, N] lse, from rows 5 + 3b of the packed lse.
  EXPECT_EQ(pieces, (std::vector<Piece>{{0, 3, 5, 11, 3, 4}, {12, 3, 8, 11, 3, 4}}));
}

}  // namespace
}  // namespace attention::cuda
