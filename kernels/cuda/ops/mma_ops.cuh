// Thin wrappers over the PTX the tensor-core kernels use: cp.async (16-byte, zero-filling),
// ldmatrix (x4, plain and transposed), mma.sync m16n8k16 (f16/bf16) and m16n8k8 (tf32) with
// float32 accumulators.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * g + t:
//   A 16x16 (row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 (k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8 float:        c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attention::cuda {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes global -> shared without staging in registers; when !valid the 16 bytes are
// zero-filled and nothing is read (src-size 0), so out-of-range rows cost no fault.
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

// c += a * b for one m16n8k16 tile; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>);
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a * b for one m16n8k8 tile in float32 precision from three tf32 products (3xTF32):
// x = hi + lo with hi = tf32(x), lo = tf32(x - hi); a*b ~ hi*hi + hi*lo + lo*hi, the dropped lo*lo
// and the rounding of lo are ~2^-22 relative. Small terms first. Fragments as for m16n8k16 with
// single 32-bit elements: a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4);
// b0 = (k t, n g), b1 = (k t+4, n g).
__device__ __forceinline__ void MmaTf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Splits float bits x into tf32 hi and lo (see MmaTf32x3).
__device__ __forceinline__ void SplitTf32(uint32_t x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(__uint_as_float(x)));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(__uint_as_float(x) - __uint_as_float(hi)));
}

// A float32 operand split once and used by several MmaTf32x3 calls.
template <int kN>
struct SplitFrag {
  uint32_t hi[kN], lo[kN];
};
template <int kN>
__device__ __forceinline__ SplitFrag<kN> Split(const uint32_t (&x)[kN]) {
  SplitFrag<kN> f;
#pragma unroll
  for (int i = 0; i < kN; ++i) SplitTf32(x[i], f.hi[i], f.lo[i]);
  return f;
}

__device__ __forceinline__ void MmaTf32x3(float (&c)[4], const SplitFrag<4>& a, uint32_t b0_hi,
                                          uint32_t b1_hi, uint32_t b0_lo, uint32_t b1_lo) {
  MmaTf32(c, a.lo, b0_hi, b1_hi);
  MmaTf32(c, a.hi, b0_lo, b1_lo);
  MmaTf32(c, a.hi, b0_hi, b1_hi);
}

// Two floats as one register of two T; `lo` takes the lower column index.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

}  // namespace attention::cuda
