// The online softmax that the forward and the paged decode kernels share, on the accumulators of
// mma.sync m16n8k{16,8} (mma_ops.cuh): a 16-row block of S is float s[kNTiles][4] per lane, lane
// 4g + t holding keys 8 nt + 2t + i (i = 0, 1) of row g (s[nt][i]) and of row g + 8
// (s[nt][2 + i]); "half" 0 or 1 picks the row. A row's logits live in the 4 lanes of a quad, so its
// statistics need two shuffles and no shared memory.
//
// Log2 domain with the scale folded in (KernelParams::scale_log2 > 0): the running max is kept on
// the raw logits, and p = exp2(scale_log2 * s - scale_log2 * max) is one FFMA and one ex2.
#pragma once

#include <cmath>

#include "kernels/cuda/ops/kernel_params.h"

namespace attention::cuda {

// 2^x on the special-function unit; 2^-inf = +0, which masked logits rely on.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Combines x[0..kN) with op as a balanced tree (ceil(log2 kN) levels; an element without a
// partner at a level passes up unchanged); x is clobbered.
template <int kN, typename Op>
__device__ __forceinline__ float TreeReduce(float (&x)[kN], Op op) {
#pragma unroll
  for (int stride = 1; stride < kN; stride *= 2)
#pragma unroll
    for (int i = 0; i + stride < kN; i += 2 * stride) x[i] = op(x[i], x[i + stride]);
  return x[0];
}

// The sum of x over the 4 lanes of this lane's quad (one row's lanes), in every one of them.
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// One row's step over a new tile of its logits s[.][2 half + i]: raises row_max (raw logits) to
// the tile's max, turns the logits into p in place, and adds this lane's share of the tile's sum to
// row_sum after rescaling it. Returns the rescale of the row's earlier terms, exp2(scale_log2 *
// (old max - new max)), which the caller applies to its O accumulators. Max and sum are trees over
// the column tiles (log2(kNTiles) dependent steps, not kNTiles). kLog2Gain: p and row_sum are
// 2^kLog2Gain times the probabilities (a constant factor that o's normalisation cancels; the
// float8 kernel's way to keep small p inside e4m3's normal range); 0 adds no instruction.
template <int kNTiles, int kLog2Gain = 0>
__device__ __forceinline__ float OnlineSoftmaxRow(float (&s)[kNTiles][4], int half, float& row_max,
                                                  float& row_sum, float scale_log2) {
  float part[kNTiles];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) part[nt] = fmaxf(s[nt][half * 2], s[nt][half * 2 + 1]);
  float mx = fmaxf(row_max, TreeReduce(part, [](float a, float b) { return fmaxf(a, b); }));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // A row that has seen no key yet keeps max -inf; subtract 0 then so exp2 gives 0, not NaN.
  const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
  const float rescale = FastExp2(row_max * scale_log2 - m_scaled);
  const float offset = kLog2Gain == 0 ? -m_scaled : static_cast<float>(kLog2Gain) - m_scaled;
  row_max = mx;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[nt][half * 2 + i] = FastExp2(fmaf(s[nt][half * 2 + i], scale_log2, offset));
    }
    part[nt] = s[nt][half * 2] + s[nt][half * 2 + 1];
  }
  row_sum = fmaf(row_sum, rescale, TreeReduce(part, [](float a, float b) { return a + b; }));
  return rescale;
}

// One key's step of a row's online softmax when keys come one at a time (the SIMT paths): raises
// row_max (raw logits) to the logit s and returns p = exp2(scale_log2 * (s - max)); `rescale` gets
// the factor of the row's earlier terms, by which the caller scales its O accumulators (row_sum is
// rescaled here). A NaN logit gives a NaN p (fmaxf keeps the max finite).
__device__ __forceinline__ float OnlineSoftmaxKey(float s, float& row_max, float& row_sum,
                                                  float scale_log2, float& rescale) {
  const float new_max = fmaxf(row_max, s);
  rescale = FastExp2((row_max - new_max) * scale_log2);
  const float p = FastExp2((s - new_max) * scale_log2);
  row_sum = row_sum * rescale + p;
  row_max = new_max;
  return p;
}

// A finished row's log2-sum-exp from its running max (raw logits) and sum l of exp2(scale_log2 (s
// - max) + log2_gain): -inf for a row that saw no key (l = 0).
__device__ __forceinline__ float RowLse2(float row_max, float l, float scale_log2,
                                         int log2_gain = 0) {
  return l > 0.f ? row_max * scale_log2 + log2f(l) - log2_gain : -INFINITY;
}

// The sink logit `sink` (natural log) of a finished row's query head joins its softmax
// denominator: the row's log2-sum-exp lse2 (-inf: it saw no key) becomes log2(2^lse2 + 2^(sink
// log2 e)), and its normalised o scales by the returned 2^(old lse2 - new lse2): 0 for a row that
// saw no key, whose o is then 0 and lse the sink (as kernels/reference has it).
__device__ __forceinline__ float AddSink(float sink, float& lse2) {
  const float sink2 = sink * kLog2e;
  const float mx = fmaxf(lse2, sink2);
  if (mx == -INFINITY) return 1.f;
  const float total = mx + log2f(exp2f(lse2 - mx) + exp2f(sink2 - mx));
  const float o_scale = exp2f(lse2 - total);
  lse2 = total;
  return o_scale;
}

// tanh(x) in one instruction on the special-function unit (tanh.approx.f32, sm_75 on;
// FlashAttention-3's cutlass::fast_tanh is the same instruction): max relative error 2^-10.987
// (PTX ISA). The 16-bit forward kernels cap with it: on top of the softmax's exp2 it is one more
// MUFU op per logit, where tanhf's ex2 + rcp (and its small-|x| polynomial) are two and ~16
// instructions. Its error, carried into o and lse, is set out at Softcap.
__device__ __forceinline__ float ApproxTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A logit of the raw q.k products (negated q for a negative scale) capped, in the log2 domain:
// softcap tanh(scale q.k / softcap) log2(e), which the softmax then takes at scale 1. Params:
// kernel params with softcap_log2 and softcap_scale.
// kApprox: tanh by ApproxTanh (the 16-bit forward kernels), else tanhf (float32, whose 1e-5
// tolerance a 2^-11 tanh would break, and the paged decode kernels, memory-bound). ApproxTanh's
// relative error e <= 2^-10.987 moves a natural-log logit c tanh(x) by at most c e |tanh x| < c e
// (c the softcap): 2.4e-3 at c = 5, 0.015 at c = 30, 0.024 at c = 50. A row's lse moves by at most
// that (lse is a smooth max of the logits), and each weight P_j by the factor exp(d_j - d), d_j
// its logit's error and d their P-weighted mean: o's relative error is at most about 2 c e where
// the errors are correlated (logits saturated alike) and far less for independent ones, beside
// bfloat16's rounding of P (2^-9) and of o (2^-9). The tests' caps (2.5 and 5) keep it below 5e-3
// of their 1e-2 bound for o and far below it for lse (|lse| of a few units).
template <bool kApprox, typename Params>
__device__ __forceinline__ float Softcap(const Params& p, float s) {
  const float x = s * p.softcap_scale;
  return p.softcap_log2 * (kApprox ? ApproxTanh(x) : tanhf(x));
}

// Softcap on every logit of an S block (float s[kNTiles][4], the mma accumulator layout).
template <bool kApprox, typename Params, int kNTiles>
__device__ __forceinline__ void SoftcapTile(const Params& p, float (&s)[kNTiles][4]) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = Softcap<kApprox>(p, s[nt][i]);
}

}  // namespace attention::cuda
