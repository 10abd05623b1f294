// The CPU backend: FlashAttention's tiled online softmax, float32 accumulation.
//
// One work item is (batch item, query head, block of kBlockM = 96 query rows). It converts its Q
// block once to float32 with softmax_scale * log2(e) folded in (so the softmax runs on exp2; for
// float8 also q_descale * k_descale, and v_descale into the final 1 / l: float32 roundings only)
// and transposes it 8x8 in registers, then streams K/V tiles of kBlockN = 64 keys, limited to the
// keys some row of the block can see (causal and windowed blocks skip fully masked tiles; only
// tiles crossing a window edge are masked element-wise). A key a row cannot see never reaches it,
// even when its K or V is Inf or NaN: masked logits are overwritten with -inf, and a tile on a
// window edge whose V holds a non-finite value (checked on those tiles only) takes P V row by row
// over each row's own keys instead of the register-blocked product, where 0 * NaN = NaN. Scores are
// kept transposed, keys x rows, so that both products are "broadcast an element of A, FMA a row of
// B" and the softmax statistics are vectors over rows:
//   S^T = K Q^T                 [keys, rows], register-blocked 6 keys x 16 rows over D; a last
//                               block of 8 rows (all rows when N <= 8) 12 keys x 8 rows
//   m_new = max(m, colmax(S^T)); P^T = exp2(S^T - m_new); l = l exp2(m - m_new) + colsum(P^T)
//   O = O exp2(m - m_new) + P V  [rows, D], register-blocked 6 rows x 16 features over the keys,
//                               the rescale applied as the accumulators load (none on tile 1)
// and finally writes O / l and lse = (m + log2 l) ln 2. float32 K and V (D a multiple of 16 for V)
// are read in place; other dtypes are converted once per tile into per-thread scratch, float16
// through F16C where the CPU has it. Scratch is O(tile): nothing is ever O(N^2).
//
// The open-model options: a softcap rewrites each tile's S^T before the mask (scalar tanh, that
// path only); a chunk size narrows each row's key range (VisibleKeys, as the window does); sinks
// join each row's l when o and lse are written; V's head dim (MLA) sizes the V tile and O.
//
// Items are sorted by their score count (longest first) and cut into tasks of at least ~4096
// scores (runs of consecutive items), which the calling thread and a persistent pool claim through
// an atomic counter, so concurrent Forward calls share the workers and thousands of tiny heads cost
// a few claims.
//
// The hot function is compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline
// x86-64, picked at load time (target_clones); the code uses 8-float GCC vectors, which each target
// lowers to its own instructions.
//
// Measured 2026-11-30 (bench/cpu, float32 B=1 H=8 N=2048 D=64, 2 cores of an AMD EPYC VM, AVX2):
// 105 GFLOP/s, 5.4x the naive OpenBLAS attention; causal 83 GFLOP/s, 8.5x. One thread: 53 GFLOP/s
// causal, ~67% of FMA peak. Table and command: bench/README.md. The service-overhead shapes
// (BM_CpuBackendService, medians): float16 B=1 H=8 N=128 D=64 on one thread 1.6 -> 0.65 ms;
// float32 B=512 H=16 N=8 D=64 on both threads 15-21 -> 11-12 ms, memory-bound
// (bench/results/2026-11-30-service-overhead-cpu.md).
#include "kernels/cpu/cpu_attention.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/vec8.h"
#include "kernels/dtype_convert.h"
#include "kernels/status_macros.h"

namespace attention::cpu {
namespace {

constexpr int64_t kBlockM = 96;  // query rows per work item
constexpr int64_t kBlockN = 64;  // keys per K/V tile
// Micro-kernel shapes: up to kMr rows of two 8-float vectors (kNr columns), or up to kMr1 rows of
// one vector; either way 12 accumulators keep both FMA pipes busy through the FMA latency.
constexpr int64_t kMr = 6;
constexpr int64_t kMr1 = 12;
constexpr int64_t kNr = 16;
static_assert(kBlockM % kNr == 0, "S^T's rows hold whole micro-tile columns");
// Score elements (rows x keys) a task should hold before load balancing splits the work finer:
// ~1 MFLOP at D = 64, so claiming a task costs well under 1% of computing it.
constexpr int64_t kTaskCost = 4096;
constexpr int64_t kTasksPerThread = 8;  // at least, where the work allows it
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Helpers of the multiversioned ComputeBlock: always inlined, so each build of it gets them
// compiled for its own target.
#define ATTENTION_INLINE inline __attribute__((always_inline))

using IVec8 = int32_t __attribute__((vector_size(32)));

ATTENTION_INLINE Vec8 Splat(float x) { return Vec8{} + x; }

// 2^x for x <= 0 (x = -inf gives 0): x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7
// Taylor polynomial (relative error < 1e-8), 2^n through the exponent bits.
ATTENTION_INLINE Vec8 Exp2(Vec8 x) {
  const Vec8 lowest = Splat(-127.0f);
  x = x < lowest ? lowest : x;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec8 n = (x + kRoundMagic) - kRoundMagic;
  const Vec8 f = x - n;
  Vec8 poly = Splat(1.5252734e-5f);
  poly = poly * f + 1.5403530e-4f;
  poly = poly * f + 1.3333558e-3f;
  poly = poly * f + 9.6181291e-3f;
  poly = poly * f + 5.5504109e-2f;
  poly = poly * f + 2.4022651e-1f;
  poly = poly * f + 6.9314718e-1f;
  poly = poly * f + 1.0f;
  // n = -127 makes the exponent field 0: the result is 0 (well below anything that matters).
  const IVec8 bits = (__builtin_convertvector(n, IVec8) + 127) << 23;
  return poly * std::bit_cast<Vec8>(bits);
}

// Transposes the 8x8 block r[0..8) (rows) into columns, in place: afterwards r[j][i] is the old
// r[i][j]. Three rounds of two-input shuffles (AVX2: unpack, shufps, vperm2f128).
ATTENTION_INLINE void Transpose8x8(Vec8 (&r)[8]) {
  Vec8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int j = 0; j < 2; ++j) {
      u[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 2 * j + 1] =
          __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  // u[0..4) hold columns {0,4}, {1,5}, {2,6}, {3,7} of rows 0-3; u[4..8) the same of rows 4-7.
  for (int j = 0; j < 4; ++j) {
    r[j] = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[j + 4] = __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// float16 rows through F16C, 8 elements an instruction (exact one way; round to nearest even the
// other, like FloatToHalf). Only called where kHaveF16c.
__attribute__((target("avx,f16c"))) void HalfRowToFloatF16c(const uint16_t* src, int64_t n,
                                                            float scale, float* dst) {
  int64_t x = 0;
  for (; x + kLanes <= n; x += kLanes) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + x)));
    _mm256_storeu_ps(dst + x, _mm256_mul_ps(f, _mm256_set1_ps(scale)));
  }
  for (; x < n; ++x) dst[x] = HalfToFloat(src[x]) * scale;
}
__attribute__((target("avx,f16c"))) void FloatRowToHalfF16c(const float* src, int64_t n,
                                                            float scale, uint16_t* dst) {
  int64_t x = 0;
  for (; x + kLanes <= n; x += kLanes) {
    const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(src + x), _mm256_set1_ps(scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + x),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; x < n; ++x) dst[x] = FloatToHalf(src[x] * scale);
}

// Whether this CPU has F16C (CPUID.1:ECX) and AVX with its registers saved by the OS (as
// __builtin_cpu_supports checks it; not every compiler knows "f16c" there). Set before main, so
// the hot path reads a plain bool.
const bool kHaveF16c = [] {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 &&
         (ecx & bit_F16C) != 0;
}();

// ConvertRow (dst[0, n) = float(src[0, n)) * scale), with float16 through F16C where the CPU has
// it: the scalar conversion costs as much as the attention math at D = 64.
ATTENTION_INLINE void LoadRow(DType dtype, const void* src, int64_t n, float scale, float* dst) {
  if (dtype == DType::kFloat16 && kHaveF16c) {
    HalfRowToFloatF16c(static_cast<const uint16_t*>(src), n, scale, dst);
  } else {
    ConvertRow(dtype, src, n, scale, dst);
  }
}

// StoreRow (dst[0, n) = src[0, n) * scale in `dtype`), with float16 through F16C likewise.
ATTENTION_INLINE void StoreOutputRow(const float* src, int64_t n, float scale, DType dtype,
                                     void* dst) {
  if (dtype == DType::kFloat16 && kHaveF16c) {
    FloatRowToHalfF16c(src, n, scale, static_cast<uint16_t*>(dst));
  } else {
    StoreRow(src, n, scale, dtype, dst);
  }
}

// c[kRows x 8 kVecs] = a[kRows x depth] * b[depth x 8 kVecs], or with kRescale
// c = diag(scale[0, kRows)) c + a b (the online softmax's rescale folded into the accumulator
// load). a's element (r, k) is a[r * a_row + k * a_depth], so a may be read transposed; b and c are
// row-major (ldb, ldc). Each step broadcasts kRows elements of a and FMAs them into one row of b.
template <int kRows, int kVecs, bool kRescale>
ATTENTION_INLINE void MicroKernel(int64_t depth, const float* a, int64_t a_row, int64_t a_depth,
                                  const float* b, int64_t ldb, float* c, int64_t ldc,
                                  const float* scale) {
  Vec8 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = kRescale ? Load(c + r * ldc + v * kLanes) * scale[r] : Vec8{};
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    Vec8 bk[kVecs];
    for (int v = 0; v < kVecs; ++v) bk[v] = Load(b + k * ldb + v * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const float ar = a[r * a_row + k * a_depth];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ar * bk[v];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
  }
}

// MicroKernel for `rows` = 1..kMaxRows rows, so no operand needs padding rows.
template <int kMaxRows, int kVecs, bool kRescale>
ATTENTION_INLINE void MicroKernelUpTo(int64_t rows, int64_t depth, const float* a, int64_t a_row,
                                      int64_t a_depth, const float* b, int64_t ldb, float* c,
                                      int64_t ldc, const float* scale) {
  if constexpr (kMaxRows > 1) {
    if (rows < kMaxRows) {
      return MicroKernelUpTo<kMaxRows - 1, kVecs, kRescale>(rows, depth, a, a_row, a_depth, b, ldb,
                                                            c, ldc, scale);
    }
  }
  MicroKernel<kMaxRows, kVecs, kRescale>(depth, a, a_row, a_depth, b, ldb, c, ldc, scale);
}

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Where one batch item's rows live and how many there are.
struct ItemExtent {
  int64_t q_offset, k_offset;  // first packed row (varlen) or 0
  int64_t nq, nk;
};

ItemExtent ExtentOf(const AttentionParams& p, int64_t b) {
  if (!p.is_varlen()) return {0, 0, p.seqlen_q, p.seqlen_k};
  return {p.cu_seqlens_q[b], p.cu_seqlens_k[b], p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b],
          p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]};
}

// Keys [begin, end) that some row of a query block can see; rows are block-local offsets.
struct KeyRange {
  int64_t begin, end;
};

// The keys query row i (item-local) sees, unclamped: its window around its diagonal key
// (MaskDiagonal), within the diagonal key's chunk (VisibleKeys). Both are nondecreasing in i.
inline int64_t LowestKey(const AttentionParams& p, const ItemExtent& e, int64_t i) {
  return VisibleKeys(p, i, e.nq, e.nk).lo;
}
inline int64_t HighestKey(const AttentionParams& p, const ItemExtent& e, int64_t i) {
  return VisibleKeys(p, i, e.nq, e.nk).hi;
}

KeyRange KeysOfBlock(const AttentionParams& p, const ItemExtent& e, int64_t row0, int64_t rows) {
  return {std::max<int64_t>(0, LowestKey(p, e, row0)),
          std::min<int64_t>(e.nk, HighestKey(p, e, row0 + rows - 1) + 1)};
}

struct WorkItem {
  int64_t batch, head, row0;
  int64_t cost;  // score elements (rows x visible keys): the sort key for load balancing
};

// Per-thread buffers, sized for one work item at head dims d (Q, K) and dv (V, O); d_pad and
// dv_pad are them rounded up to kNr.
struct Scratch {
  std::vector<float> storage;
  float* qt;  // [d, kBlockM]       Q block transposed, * scale * log2(e); zero beyond its rows
  float* k;   // [kBlockN, d]       K tile as float32 (when K is not float32)
  float* v;   // [kBlockN, dv_pad]  V tile as float32, zero beyond dv (when V is not read in place)
  float* st;  // [kBlockN, kBlockM] scores transposed, then probabilities
  float* o;   // [kBlockM, dv_pad]  unnormalised output
  float* m;   // [kBlockM]          running row max (log2 domain)
  float* l;   // [kBlockM]          running row sum
  float* alpha;  // [kBlockM]         this tile's rescale factor exp2(m_old - m_new)
  float* rows8;  // [kLanes, d_pad]   kLanes Q rows converted, before their transposition

  void Prepare(int64_t d, int64_t d_pad, int64_t dv_pad) {
    constexpr int64_t kAlign = 16;  // floats: every buffer starts on a 64-byte boundary
    const int64_t sizes[] = {d * kBlockM,       kBlockN * d,      kBlockN * dv_pad,
                             kBlockN * kBlockM, kBlockM * dv_pad, kBlockM,
                             kBlockM,           kBlockM,          kLanes * d_pad};
    float** buffers[] = {&qt, &k, &v, &st, &o, &m, &l, &alpha, &rows8};
    int64_t total = kAlign;
    for (int64_t size : sizes) total += RoundUp(size, kAlign);
    if (static_cast<int64_t>(storage.size()) < total) storage.resize(total);
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    float* next =
        storage.data() + (RoundUp(address, kAlign * sizeof(float)) - address) / sizeof(float);
    for (size_t i = 0; i < std::size(sizes); ++i) {
      *buffers[i] = next;
      next += RoundUp(sizes[i], kAlign);
    }
  }
};

// qt: [d, kBlockM] columns [0, cols) <- q rows [row0, row0 + rows) of (batch, head) scaled into
// the exp2 domain, zero in columns [rows, cols). Rows are converted kLanes at a time into rows8
// and transposed 8x8 in registers.
ATTENTION_INLINE void LoadQTransposed(const AttentionParams& p, const ItemExtent& e,
                                      const WorkItem& item, int64_t rows, int64_t cols,
                                      Scratch& scratch) {
  const int64_t d = p.head_dim;
  const int64_t d_pad = RoundUp(d, kNr);
  const size_t elem = DTypeSize(p.dtype);
  const auto* q_base = static_cast<const unsigned char*>(p.q);
  float* const rows8 = scratch.rows8;
  for (int64_t i0 = 0; i0 < cols; i0 += kLanes) {
    for (int64_t r = 0; r < kLanes; ++r) {
      const int64_t i = i0 + r;
      if (i >= rows) {
        std::fill(rows8 + r * d_pad, rows8 + r * d_pad + d, 0.0f);
        continue;
      }
      const int64_t at = item.batch * p.q_batch_stride +
                         (e.q_offset + item.row0 + i) * p.q_row_stride +
                         item.head * p.q_head_stride;
      LoadRow(p.dtype, q_base + at * elem, d, EffectiveSoftmaxScale(p) * kLog2e, rows8 + r * d_pad);
    }
    int64_t x0 = 0;
    for (; x0 + kLanes <= d; x0 += kLanes) {
      Vec8 block[kLanes];
      for (int64_t r = 0; r < kLanes; ++r) block[r] = Load(rows8 + r * d_pad + x0);
      Transpose8x8(block);
      for (int64_t x = 0; x < kLanes; ++x) Store(scratch.qt + (x0 + x) * kBlockM + i0, block[x]);
    }
    for (; x0 < d; ++x0) {
      for (int64_t r = 0; r < kLanes; ++r) {
        scratch.qt[x0 * kBlockM + i0 + r] = rows8[r * d_pad + x0];
      }
    }
  }
}

// Sets S^T columns [0, cols) to -inf where a row of the block cannot see the key: row i sees keys
// LowestKey(i)..HighestKey(i) (block-local rows; key0 + j is key j of the tile).
ATTENTION_INLINE void MaskTile(const AttentionParams& p, const ItemExtent& e, int64_t row0,
                               int64_t key0, int64_t kn, int64_t cols, float* st) {
  for (int64_t i = 0; i < cols; ++i) {
    const int64_t lo = std::clamp<int64_t>(LowestKey(p, e, row0 + i) - key0, 0, kn);
    const int64_t hi = std::clamp<int64_t>(HighestKey(p, e, row0 + i) + 1 - key0, lo, kn);
    for (int64_t j = 0; j < lo; ++j) st[j * kBlockM + i] = kNegInf;
    for (int64_t j = hi; j < kn; ++j) st[j * kBlockM + i] = kNegInf;
  }
}

// Logit softcapping on S^T [kn, cols] in the log2 domain: s = c tanh(s / c) on natural-log logits
// is s2 = c2 tanh(s2 / c2) with c2 = c log2(e). Before the mask, which overwrites what it hides.
ATTENTION_INLINE void SoftcapTile(float softcap, int64_t kn, int64_t cols, float* st) {
  const float c2 = softcap * kLog2e;
  for (int64_t j = 0; j < kn; ++j) {
    for (int64_t i = 0; i < cols; ++i)
      st[j * kBlockM + i] = c2 * std::tanh(st[j * kBlockM + i] / c2);
  }
}

// Whether rows [0, kn) of v (row stride ldv) hold a non-finite element in columns [0, d).
ATTENTION_INLINE bool HasNonFinite(const float* v, int64_t ldv, int64_t kn, int64_t d) {
  constexpr uint32_t kExponent = 0x7f800000u;  // all ones: Inf or NaN
  uint32_t bad = 0;
  for (int64_t j = 0; j < kn; ++j) {
    for (int64_t x = 0; x < d; ++x) {
      bad |= (std::bit_cast<uint32_t>(v[j * ldv + x]) & kExponent) == kExponent;
    }
  }
  return bad != 0;
}

// O = diag(alpha) O + P V (O = P V on the first tile) row by row, each row summing only the keys
// of the tile it sees (MaskTile's ranges, as key indices): for tiles on a window edge whose V holds
// a non-finite value, which the register-blocked product would spread to the rows that mask its key
// (their P is 0, and 0 * NaN = NaN). st: [kn, kBlockM] P^T; v: [kn, d_pad] with row stride ldv;
// o: [rows, d_pad].
ATTENTION_INLINE void MaskedPvRows(const AttentionParams& p, const ItemExtent& e, int64_t row0,
                                   int64_t rows, int64_t key0, int64_t kn, const float* st,
                                   const float* v, int64_t ldv, int64_t d_pad, bool first_tile,
                                   const float* alpha, float* o) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t lo = std::clamp<int64_t>(LowestKey(p, e, row0 + i) - key0, 0, kn);
    const int64_t hi = std::clamp<int64_t>(HighestKey(p, e, row0 + i) + 1 - key0, lo, kn);
    for (int64_t c = 0; c < d_pad; c += kLanes) {
      Vec8 acc = first_tile ? Vec8{} : Load(o + i * d_pad + c) * alpha[i];
      for (int64_t j = lo; j < hi; ++j) acc += st[j * kBlockM + i] * Load(v + j * ldv + c);
      Store(o + i * d_pad + c, acc);
    }
  }
}

// Online softmax over one tile, 8 rows at a time (columns of S^T): with m_new = max(m,
// colmax(S^T)), P^T = exp2(S^T - m_new) in place, alpha = exp2(m - m_new), l = l alpha +
// colsum(P^T), m = m_new. st: [kn, kBlockM]; m, l, alpha: [cols].
ATTENTION_INLINE void SoftmaxTile(int64_t kn, int64_t cols, float* st, float* m, float* l,
                                  float* alpha) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec8 m_old = Load(m + c);
    Vec8 m_new = m_old;
    for (int64_t j = 0; j < kn; ++j) {
      const Vec8 x = Load(st + j * kBlockM + c);
      m_new = x > m_new ? x : m_new;
    }
    // Rows with no visible key yet keep m = -inf; shifting them by 0 makes their P and alpha 0.
    const Vec8 shift = m_new == kNegInf ? Vec8{} : m_new;
    Vec8 sum{};
    for (int64_t j = 0; j < kn; ++j) {
      const Vec8 prob = Exp2(Load(st + j * kBlockM + c) - shift);
      Store(st + j * kBlockM + c, prob);
      sum += prob;
    }
    const Vec8 a = Exp2(m_old - shift);
    Store(alpha + c, a);
    Store(l + c, Load(l + c) * a + sum);
    Store(m + c, m_new);
  }
}

// The hot function in three builds, picked at load time by an ifunc resolver. ThreadSanitizer
// builds use the baseline one alone: GCC instruments the resolver, which runs during relocation,
// before the TSan runtime is up.
#if defined(__SANITIZE_THREAD__)
#define ATTENTION_MULTIVERSIONED
#else
#define ATTENTION_MULTIVERSIONED \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

// Computes one work item: rows [row0, row0 + kBlockM) of (batch, head). `scratch` is Prepared for
// p.head_dim.
ATTENTION_MULTIVERSIONED void ComputeBlock(const AttentionParams& p, const WorkItem& item,
                                           Scratch& scratch) {
  const int64_t d = p.head_dim;
  const int64_t dv = p.value_head_dim();
  const int64_t dv_pad = RoundUp(dv, kNr);
  const size_t elem = DTypeSize(p.dtype);
  const ItemExtent e = ExtentOf(p, item.batch);
  const int64_t hk = item.head / (p.heads_q / p.heads_kv);
  const int64_t rows = std::min(kBlockM, e.nq - item.row0);
  const int64_t cols = RoundUp(rows, kLanes);  // S^T columns computed: rows, padded with zero q
  float* const st = scratch.st;
  float* const o = scratch.o;
  float* const m = scratch.m;
  float* const l = scratch.l;

  LoadQTransposed(p, e, item, rows, cols, scratch);
  std::fill(m, m + cols, kNegInf);
  std::fill(l, l + cols, 0.0f);

  const KeyRange keys = KeysOfBlock(p, e, item.row0, rows);
  // No tile ever writes O: its rows come out 0.
  if (keys.begin >= keys.end) std::fill(o, o + rows * dv_pad, 0.0f);
  // A tile needs element-wise masking unless every row sees all of it.
  const int64_t all_rows_lo = LowestKey(p, e, item.row0 + rows - 1);
  const int64_t all_rows_hi = HighestKey(p, e, item.row0);
  const bool kv_float32 = p.dtype == DType::kFloat32;
  const bool v_in_place = kv_float32 && dv == dv_pad;
  const auto* k_base = static_cast<const unsigned char*>(p.k);
  const auto* v_base = static_cast<const unsigned char*>(p.v);
  for (int64_t key0 = keys.begin; key0 < keys.end; key0 += kBlockN) {
    const int64_t kn = std::min(kBlockN, keys.end - key0);
    const int64_t k_at =
        item.batch * p.k_batch_stride + (e.k_offset + key0) * p.k_row_stride + hk * p.k_head_stride;
    const int64_t v_at =
        item.batch * p.v_batch_stride + (e.k_offset + key0) * p.v_row_stride + hk * p.v_head_stride;
    // k: [kn, d] with row stride ldk; v: [kn, dv_pad] with row stride ldv.
    const float* k = scratch.k;
    int64_t ldk = d;
    if (kv_float32) {
      k = reinterpret_cast<const float*>(k_base) + k_at;
      ldk = p.k_row_stride;
    } else {
      for (int64_t j = 0; j < kn; ++j) {
        LoadRow(p.dtype, k_base + (k_at + j * p.k_row_stride) * elem, d, 1.0f, scratch.k + j * d);
      }
    }
    const float* v = scratch.v;
    int64_t ldv = dv_pad;
    if (v_in_place) {
      v = reinterpret_cast<const float*>(v_base) + v_at;
      ldv = p.v_row_stride;
    } else {
      for (int64_t j = 0; j < kn; ++j) {
        float* const dst = scratch.v + j * dv_pad;
        LoadRow(p.dtype, v_base + (v_at + j * p.v_row_stride) * elem, dv, 1.0f, dst);
        std::fill(dst + dv, dst + dv_pad, 0.0f);
      }
    }

    // S^T = K Q^T: [kn, cols], log2 domain, in column blocks of 16; a last block of 8 (rows of
    // at most 8, as in decode steps) takes the one-vector kernel.
    const int64_t cols16 = cols / kNr * kNr;
    for (int64_t j = 0; j < kn; j += kMr) {
      for (int64_t c = 0; c < cols16; c += kNr) {
        MicroKernelUpTo<kMr, 2, false>(std::min(kMr, kn - j), d, k + j * ldk, ldk, 1,
                                       scratch.qt + c, kBlockM, st + j * kBlockM + c, kBlockM,
                                       nullptr);
      }
    }
    for (int64_t j = 0; cols16 < cols && j < kn; j += kMr1) {
      MicroKernelUpTo<kMr1, 1, false>(std::min(kMr1, kn - j), d, k + j * ldk, ldk, 1,
                                      scratch.qt + cols16, kBlockM, st + j * kBlockM + cols16,
                                      kBlockM, nullptr);
    }
    if (p.softcap > 0.0f) SoftcapTile(p.softcap, kn, cols, st);
    // MaskTile overwrites (not adds to) the masked logits, so a NaN logit of a non-finite K at a
    // masked key becomes -inf too, and its P exactly 0.
    const bool masked = key0 < all_rows_lo || key0 + kn - 1 > all_rows_hi;
    if (masked) MaskTile(p, e, item.row0, key0, kn, cols, st);
    SoftmaxTile(kn, cols, st, m, l, scratch.alpha);

    // O = diag(alpha) O + P V: [rows, dv_pad], over the kn keys of the tile (P read from P^T); the
    // first tile starts from O = 0.
    const bool first_tile = key0 == keys.begin;
    if (masked && HasNonFinite(v, ldv, kn, dv)) {
      MaskedPvRows(p, e, item.row0, rows, key0, kn, st, v, ldv, dv_pad, first_tile, scratch.alpha,
                   o);
      continue;
    }
    for (int64_t i = 0; i < rows; i += kMr) {
      const int64_t mr = std::min(kMr, rows - i);
      for (int64_t c = 0; c < dv_pad; c += kNr) {
        float* const oc = o + i * dv_pad + c;
        if (first_tile) {
          MicroKernelUpTo<kMr, 2, false>(mr, kn, st + i, 1, kBlockM, v + c, ldv, oc, dv_pad,
                                         nullptr);
        } else {
          MicroKernelUpTo<kMr, 2, true>(mr, kn, st + i, 1, kBlockM, v + c, ldv, oc, dv_pad,
                                        scratch.alpha + i);
        }
      }
    }
  }

  // o = O v_descale / l in the output dtype; rows that saw no key get o = 0, lse = -inf. A sink
  // s (log2 domain s2 = s log2(e)) joins the row's statistics as one more term of l without a
  // value: with m' = max(m, s2), l' = l 2^(m - m') + 2^(s2 - m') and O scales by 2^(m - m').
  const float sink2 = p.sinks != nullptr ? p.sinks[item.head] * kLog2e : kNegInf;
  const DType o_dtype = OutputDType(p.dtype);
  const size_t o_elem = DTypeSize(o_dtype);
  auto* o_base = static_cast<unsigned char*>(p.o);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = e.q_offset + item.row0 + i;
    void* const dst = o_base + (item.batch * p.o_batch_stride + row * p.o_row_stride +
                                item.head * p.o_head_stride) *
                                   o_elem;
    float row_max = m[i], row_sum = l[i], o_scale = 1.0f;
    if (sink2 > row_max) {
      o_scale = std::exp2(row_max - sink2);  // 0 for a row that saw no key (m = -inf)
      row_sum = row_sum * o_scale + 1.0f;
      row_max = sink2;
    } else if (sink2 != kNegInf) {
      row_sum += std::exp2(sink2 - row_max);
    }
    StoreOutputRow(o + i * dv_pad, dv, row_sum > 0.0f ? p.v_descale * o_scale / row_sum : 0.0f,
                   o_dtype, dst);
    if (p.lse != nullptr) {
      p.lse[item.batch * p.lse_batch_stride + item.head * p.lse_head_stride + row] =
          row_sum > 0.0f ? (row_max + std::log2(row_sum)) * kLn2 : kNegInf;
    }
  }
}

absl::Status CheckVarlen(const AttentionParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.cu_seqlens_q[b + 1] < p.cu_seqlens_q[b] || p.cu_seqlens_k[b + 1] < p.cu_seqlens_k[b]) {
      return absl::InvalidArgumentError(absl::StrCat("cu_seqlens decrease at item ", b));
    }
  }
  if (p.cu_seqlens_q[0] < 0 || p.cu_seqlens_k[0] < 0 || p.cu_seqlens_q[p.batch] > p.total_q ||
      p.cu_seqlens_k[p.batch] > p.total_k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cu_seqlens outside [0, total] (total_q=", p.total_q, ", total_k=", p.total_k, ")"));
  }
  return absl::OkStatus();
}

// One Forward call's items, cut into tasks (runs of consecutive items) that whichever threads
// join in claim one at a time.
struct Job {
  const AttentionParams* params = nullptr;
  std::vector<WorkItem> items;    // longest first
  std::vector<size_t> task_ends;  // task t is items [task_ends[t - 1] (or 0), task_ends[t])
  std::atomic<size_t> next{0};    // next task to claim
  std::atomic<size_t> done{0};    // tasks finished
  std::mutex mu;
  std::condition_variable all_done;
};

// Cuts job.items into tasks of at least `grain` score elements (the last may hold less), so that
// thousands of tiny heads (decode steps, N = 8 items) cost a few claims, not one each.
void CutTasks(Job& job, int threads) {
  int64_t total = 0;
  for (const WorkItem& item : job.items) total += item.cost;
  const int64_t grain = std::min(kTaskCost, total / (int64_t{threads} * kTasksPerThread));
  int64_t cost = 0;
  for (size_t i = 0; i < job.items.size(); ++i) {
    cost += job.items[i].cost;
    if (cost >= grain || i + 1 == job.items.size()) {
      job.task_ends.push_back(i + 1);
      cost = 0;
    }
  }
}

}  // namespace

struct CpuBackend::Impl {
  int threads = 1;
  std::mutex mu;
  std::condition_variable has_work;
  std::deque<std::shared_ptr<Job>> jobs;  // jobs with items left to claim
  bool stop = false;
  std::vector<std::thread> workers;

  // Claims and computes tasks of `job` until none are left. The params are read only while this
  // thread holds a claimed task: a pool worker may pick the job up after every task is done, when
  // Forward has returned and its caller may have freed them.
  static void Work(Job& job) {
    thread_local Scratch scratch;
    const size_t tasks = job.task_ends.size();
    bool prepared = false;
    for (size_t t; (t = job.next.fetch_add(1)) < tasks;) {
      const AttentionParams& p = *job.params;
      if (!prepared) {
        scratch.Prepare(p.head_dim, RoundUp(p.head_dim, kNr), RoundUp(p.value_head_dim(), kNr));
        prepared = true;
      }
      // A stopped run still claims and counts its tasks, so Forward's wait ends; it computes
      // nothing more. The check between items (one query tile of one head over its keys) bounds
      // how long a stop waits.
      for (size_t i = t == 0 ? 0 : job.task_ends[t - 1];
           i < job.task_ends[t] && !StopRequested(p.stop); ++i) {
        ComputeBlock(p, job.items[i], scratch);
      }
      if (job.done.fetch_add(1) + 1 == tasks) {
        std::lock_guard<std::mutex> lock(job.mu);
        job.all_done.notify_all();
      }
    }
  }

  void Retire(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = std::find(jobs.begin(), jobs.end(), job);
    if (it != jobs.end()) jobs.erase(it);
  }

  void WorkerLoop() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        has_work.wait(lock, [this] { return stop || !jobs.empty(); });
        if (stop) return;
        job = jobs.front();
      }
      Work(*job);
      Retire(job);
    }
  }
};

namespace {

// CPUs this process may run on (taskset, cpusets), which hardware_concurrency() ignores.
int UsableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

CpuBackend::CpuBackend(const CpuBackendOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->threads = options.threads > 0 ? options.threads : UsableCpus();
  // The calling thread computes too, so threads - 1 workers make `threads` in all.
  for (int t = 1; t < impl_->threads; ++t) {
    impl_->workers.emplace_back([impl = impl_.get()] { impl->WorkerLoop(); });
  }
}

CpuBackend::~CpuBackend() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->has_work.notify_all();
  for (std::thread& worker : impl_->workers) worker.join();
}

int CpuBackend::threads() const { return impl_->threads; }

absl::Status CpuBackend::Forward(const AttentionParams& p) {
  RETURN_IF_ERROR(CheckParams(p));
  if (p.is_varlen()) RETURN_IF_ERROR(CheckVarlen(p));

  auto job = std::make_shared<Job>();
  job->params = &p;
  if (!p.is_varlen()) {
    job->items.reserve(p.batch * p.heads_q * RoundUp(p.seqlen_q, kBlockM) / kBlockM);
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    const ItemExtent e = ExtentOf(p, b);
    for (int64_t row0 = 0; row0 < e.nq; row0 += kBlockM) {
      const int64_t rows = std::min(kBlockM, e.nq - row0);
      const KeyRange keys = KeysOfBlock(p, e, row0, rows);
      const int64_t cost = rows * std::max<int64_t>(0, keys.end - keys.begin);
      for (int64_t h = 0; h < p.heads_q; ++h) job->items.push_back({b, h, row0, cost});
    }
  }
  if (job->items.empty()) return absl::OkStatus();
  // Longest first, so the last items to finish are short ones (causal blocks differ up to N/64x).
  // Equal costs (thousands of tiny heads) are already in order.
  const auto longer = [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; };
  if (!std::is_sorted(job->items.begin(), job->items.end(), longer)) {
    std::stable_sort(job->items.begin(), job->items.end(), longer);
  }
  CutTasks(*job, impl_->threads);

  const bool share = !impl_->workers.empty() && job->task_ends.size() > 1;
  if (share) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->jobs.push_back(job);
    }
    impl_->has_work.notify_all();
  }
  Impl::Work(*job);
  if (share) {
    impl_->Retire(job);
    std::unique_lock<std::mutex> lock(job->mu);
    job->all_done.wait(lock, [&] { return job->done.load() == job->task_ends.size(); });
  }
  if (StopRequested(p.stop)) return StoppedError();
  return absl::OkStatus();
}

}  // namespace attention::cpu
