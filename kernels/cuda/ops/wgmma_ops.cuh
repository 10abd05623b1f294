// Hopper (sm_90a) building blocks of the wgmma forward kernel (flash_forward_sm90_kernel.cuh):
// mbarriers, TMA tile loads, the wgmma instructions it issues (their shared-memory descriptors
// are in smem_desc.h), warpgroup register reallocation. Everything here is PTX that exists only
// for sm_90a: callers compile it inside `#if ATTENTION_SM90A` (defined below), so the sm_80 pass
// of the build sees none of it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/ops/smem_desc.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTENTION_SM90A 1
#else
#define ATTENTION_SM90A 0
#endif

namespace attention::cuda {

#if ATTENTION_SM90A

// ---- mbarriers (shared::cta, 8 bytes each) ----

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Announces `bytes` of TMA transactions on bar and arrives once.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `phase` of bar has completed. A fresh barrier counts its
// previous phase (parity 1) as completed, so a producer's first wait on an "empty" barrier with
// parity 1 returns at once.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  }
}

// ---- TMA ----

// A 4-D tile of `map` at element coordinates (c0 innermost .. c3) into shared memory at dst,
// completing `bar`'s transaction count. Coordinates past the tensor's extent read zeros.
__device__ __forceinline__ void TmaLoad4d(uint32_t dst, const void* map, uint32_t bar, int c0,
                                          int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// A 4-D box of shared memory at src (laid out as TmaLoad4d's) into `map` at element coordinates
// (c0 innermost .. c3): elements past the tensor's extent are not written. Asynchronous: one
// bulk group per commit (TmaStoreCommit), src may be written again after TmaStoreWait<true>.
__device__ __forceinline__ void TmaStore4d(const void* map, uint32_t src, int c0, int c1, int c2,
                                           int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
__device__ __forceinline__ void TmaStoreCommit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's committed stores have read their shared memory (kRead) or are done.
template <bool kRead>
__device__ __forceinline__ void TmaStoreWait() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}
// Orders this thread's generic-proxy shared stores before later async-proxy (TMA) reads.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8x8 matrices of 16-bit elements into shared memory: lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes), and r[i] is its part of matrix i in the mma.sync accumulator layout
// (row lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1, the lower column in the low half).
__device__ __forceinline__ void StoreMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                              uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---- wgmma ----

// Orders this thread's register writes before the warpgroup's next wgmma reads them.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses to accumulator registers across an asynchronous wgmma.
template <int kN>
__device__ __forceinline__ void FenceRegisters(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Four float32 values rounded to e4m3 (saturating at +-448) in one register, a in the lowest
// byte: the layout of 4 consecutive k of an e4m3 wgmma A fragment.
__device__ __forceinline__ uint32_t PackE4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// ---- warpgroup roles ----

template <int kRegs>
__device__ __forceinline__ void WarpgroupRegistersDown() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void WarpgroupRegistersUp() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Synchronises the 128 threads of one warpgroup on named barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupSync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
// Synchronises kWarpgroups warpgroups (128 kWarpgroups threads) on named barrier `id`.
template <int kWarpgroups>
__device__ __forceinline__ void WarpgroupsSync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(128 * kWarpgroups) : "memory");
}

// wgmma.mma_async with float32 accumulators d (64 x N over the warpgroup, the layout of N/8
// mma.sync m16n8 accumulators per warp: d[4j..4j+3] is column tile j), scale_d = 0 to overwrite d.
// WgmmaSS: A (64 x K, K-major) and B (N x K, K-major) from shared memory. WgmmaRS: A from
// registers, B (K x N) from shared memory. 16-bit types: k16, A the m16n8k16 A fragment of this
// warp's 16 rows, B MN-major (imm-trans-b = 1: V tiles as TMA stores them, rows of keys).
// float8 e4m3: k32, both operands K-major (the only layout wgmma takes for 8-bit types), A's
// registers a[0..3] = rows g, g + 8, g, g + 8 of the warp's 16 (g = lane / 4), each 4 elements at
// k = 4 (lane % 4) + {0..3} (a[0], a[1]) and 16 + 4 (lane % 4) + {0..3} (a[2], a[3]).
// One overload per N the kernel uses, for __half, __nv_bfloat16 and __nv_fp8_e4m3 (the macros
// spell each instruction once per N; the type's part comes from ATTENTION_WGMMA_TYPED).
template <typename T, int kN>
struct WgmmaTag {};

// The accumulator operands d[i .. i + 7] and d[i .. i + 31] of the wrappers below.
#define ATTENTION_WGMMA_ACC8(i)                                                               \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define ATTENTION_WGMMA_ACC32(i)                                                      \
  ATTENTION_WGMMA_ACC8(i), ATTENTION_WGMMA_ACC8(i + 8), ATTENTION_WGMMA_ACC8(i + 16), \
      ATTENTION_WGMMA_ACC8(i + 24)
// The accumulators' places in the instruction: {%0, .., %(n - 1)}.
#define ATTENTION_WGMMA_D32                                                                      \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTENTION_WGMMA_D40                                                                      \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
  "%38, %39}"
#define ATTENTION_WGMMA_D64                                                                      \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define ATTENTION_WGMMA_D128                                                                       \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "     \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "     \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "     \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "     \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, " \
  "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "     \
  "%124, %125, %126, %127}"
// INSTR(k and types, the operands after the descriptors) for element type T: 16-bit types k16
// with the transpose immediates (SS: none; RS: B MN-major), e4m3 k32 without them.
#define ATTENTION_WGMMA_TYPED(T, INSTR, TRANS_16BIT)               \
  if constexpr (std::is_same_v<T, __half>) {                       \
    INSTR("k16.f32.f16.f16", ", p, 1, 1" TRANS_16BIT);             \
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {         \
    INSTR("k16.f32.bf16.bf16", ", p, 1, 1" TRANS_16BIT);           \
  } else {                                                         \
    static_assert(std::is_same_v<T, __nv_fp8_e4m3>, "wgmma type"); \
    INSTR("k32.f32.e4m3.e4m3", ", p, 1, 1");                       \
  }
#define ATTENTION_WGMMA_SS_TRANS ", 0, 0"  // A and B K-major
#define ATTENTION_WGMMA_RS_TRANS ", 1"     // B MN-major

template <typename T>
__device__ __forceinline__ void WgmmaSS(WgmmaTag<T, 80>, float (&d)[40], uint64_t desc_a,
                                        uint64_t desc_b, int scale_d) {
#define ATTENTION_INSTR(KTYPES, TAIL)                                                             \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n80" KTYPES ATTENTION_WGMMA_D40 ", %40, %41" TAIL ";\n}\n" \
      : ATTENTION_WGMMA_ACC32(0), ATTENTION_WGMMA_ACC8(32)                                        \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
  ATTENTION_WGMMA_TYPED(T, ATTENTION_INSTR, ATTENTION_WGMMA_SS_TRANS);
#undef ATTENTION_INSTR
}

template <typename T>
__device__ __forceinline__ void WgmmaSS(WgmmaTag<T, 128>, float (&d)[64], uint64_t desc_a,
                                        uint64_t desc_b, int scale_d) {
#define ATTENTION_INSTR(KTYPES, TAIL)                                                              \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128" KTYPES ATTENTION_WGMMA_D64 ", %64, %65" TAIL ";\n}\n" \
      : ATTENTION_WGMMA_ACC32(0), ATTENTION_WGMMA_ACC32(32)                                        \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
  ATTENTION_WGMMA_TYPED(T, ATTENTION_INSTR, ATTENTION_WGMMA_SS_TRANS);
#undef ATTENTION_INSTR
}

template <typename T>
__device__ __forceinline__ void WgmmaRS(WgmmaTag<T, 64>, float (&d)[32], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
#define ATTENTION_INSTR(KTYPES, TAIL)                                  \
  asm volatile(                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                     \
      "wgmma.mma_async.sync.aligned.m64n64" KTYPES ATTENTION_WGMMA_D32 \
      ", {%32, %33, %34, %35}, %36" TAIL ";\n}\n"                      \
      : ATTENTION_WGMMA_ACC32(0)                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
  ATTENTION_WGMMA_TYPED(T, ATTENTION_INSTR, ATTENTION_WGMMA_RS_TRANS);
#undef ATTENTION_INSTR
}

template <typename T>
__device__ __forceinline__ void WgmmaRS(WgmmaTag<T, 128>, float (&d)[64], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
#define ATTENTION_INSTR(KTYPES, TAIL)                                   \
  asm volatile(                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                      \
      "wgmma.mma_async.sync.aligned.m64n128" KTYPES ATTENTION_WGMMA_D64 \
      ", {%64, %65, %66, %67}, %68" TAIL ";\n}\n"                       \
      : ATTENTION_WGMMA_ACC32(0), ATTENTION_WGMMA_ACC32(32)             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
  ATTENTION_WGMMA_TYPED(T, ATTENTION_INSTR, ATTENTION_WGMMA_RS_TRANS);
#undef ATTENTION_INSTR
}

template <typename T>
__device__ __forceinline__ void WgmmaRS(WgmmaTag<T, 256>, float (&d)[128], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
#define ATTENTION_INSTR(KTYPES, TAIL)                                                   \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                     \
      "wgmma.mma_async.sync.aligned.m64n256" KTYPES ATTENTION_WGMMA_D128                \
      ", {%128, %129, %130, %131}, %132" TAIL ";\n}\n"                                  \
      : ATTENTION_WGMMA_ACC32(0), ATTENTION_WGMMA_ACC32(32), ATTENTION_WGMMA_ACC32(64), \
        ATTENTION_WGMMA_ACC32(96)                                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
  ATTENTION_WGMMA_TYPED(T, ATTENTION_INSTR, ATTENTION_WGMMA_RS_TRANS);
#undef ATTENTION_INSTR
}

#undef ATTENTION_WGMMA_RS_TRANS
#undef ATTENTION_WGMMA_SS_TRANS
#undef ATTENTION_WGMMA_TYPED
#undef ATTENTION_WGMMA_D128
#undef ATTENTION_WGMMA_D64
#undef ATTENTION_WGMMA_D40
#undef ATTENTION_WGMMA_D32
#undef ATTENTION_WGMMA_ACC32
#undef ATTENTION_WGMMA_ACC8

#endif  // ATTENTION_SM90A

}  // namespace attention::cuda
