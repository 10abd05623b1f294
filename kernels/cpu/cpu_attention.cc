// The CPU backend: FlashAttention's tiled online softmax, float32 accumulation.
//
// One work item is (batch item, query head, block of kBlockM = 96 query rows). It converts its Q
// block once to float32, transposed, with softmax_scale * log2(e) folded in (so the softmax runs on
// exp2), then streams K/V tiles of kBlockN = 64 keys, limited to the keys some row of the block
// can see (causal and windowed blocks skip fully masked tiles; only tiles crossing a window edge
// are masked element-wise). Scores are kept transposed, keys x rows, so that both products are
// "broadcast an element of A, FMA a row of B" and the softmax statistics are vectors over rows:
//   S^T = K Q^T                 [keys, rows], register-blocked 6 keys x 16 rows over D
//   m_new = max(m, colmax(S^T)); P^T = exp2(S^T - m_new); l = l exp2(m - m_new) + colsum(P^T)
//   O = O exp2(m - m_new) + P V  [rows, D], register-blocked 6 rows x 16 features over the keys
// and finally writes O / l and lse = (m + log2 l) ln 2. float32 K and V (D a multiple of 16 for V)
// are read in place; other dtypes are converted once per tile into per-thread scratch. Scratch is
// O(tile): nothing is ever O(N^2).
//
// Items are sorted by their key count (longest first) and claimed through an atomic counter by the
// calling thread and a persistent pool, so concurrent Forward calls share the workers.
//
// The hot function is compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline
// x86-64, picked at load time (target_clones); the code uses 8-float GCC vectors, which each target
// lowers to its own instructions.
//
// Measured 2026-11-30 (bench/cpu, float32 B=1 H=8 N=2048 D=64, 2 cores of an AMD EPYC VM, AVX2):
// 105 GFLOP/s, 5.4x the naive OpenBLAS attention; causal 83 GFLOP/s, 8.5x. One thread: 53 GFLOP/s
// causal, ~67% of FMA peak. Table and command: bench/README.md.
#include "kernels/cpu/cpu_attention.h"

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
#include "kernels/dtype_convert.h"

namespace attention::cpu {
namespace {

constexpr int64_t kBlockM = 96;  // query rows per work item
constexpr int64_t kBlockN = 64;  // keys per K/V tile
constexpr int64_t kMr = 6;       // micro-kernel rows (at most; partial micro-tiles use fewer)
constexpr int64_t kNr = 16;      // micro-kernel columns: two 8-float vectors
static_assert(kBlockM % kNr == 0, "S^T's rows hold whole micro-tile columns");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using Vec8 = float __attribute__((vector_size(32)));
using IVec8 = int32_t __attribute__((vector_size(32)));

// Scratch buffers are 64-byte aligned (see Scratch); memcpy keeps unaligned rows legal too.
inline Vec8 Load(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec8 Splat(float x) { return Vec8{} + x; }

// 2^x for x <= 0 (x = -inf gives 0): x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7
// Taylor polynomial (relative error < 1e-8), 2^n through the exponent bits.
inline Vec8 Exp2(Vec8 x) {
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

inline float HorizontalMax(Vec8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}
inline float HorizontalSum(Vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// c[kRows x kNr] = (or +=) a[kRows x depth] * b[depth x kNr]. a's element (r, k) is
// a[r * a_row + k * a_depth], so a may be read transposed; b and c are row-major (ldb, ldc). Each
// step broadcasts kRows elements of a and FMAs them into one row of b.
template <int kRows, bool kAccumulate>
inline void MicroKernel(int64_t depth, const float* a, int64_t a_row, int64_t a_depth,
                        const float* b, int64_t ldb, float* c, int64_t ldc) {
  Vec8 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = kAccumulate ? Load(c + r * ldc) : Vec8{};
    acc[r][1] = kAccumulate ? Load(c + r * ldc + 8) : Vec8{};
  }
  for (int64_t k = 0; k < depth; ++k) {
    const Vec8 b0 = Load(b + k * ldb);
    const Vec8 b1 = Load(b + k * ldb + 8);
    for (int r = 0; r < kRows; ++r) {
      const float ar = a[r * a_row + k * a_depth];
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    Store(c + r * ldc, acc[r][0]);
    Store(c + r * ldc + 8, acc[r][1]);
  }
}

// MicroKernel for `rows` = 1..kMr rows, so no operand needs padding rows.
template <bool kAccumulate>
inline void MicroKernelRows(int64_t rows, int64_t depth, const float* a, int64_t a_row,
                            int64_t a_depth, const float* b, int64_t ldb, float* c, int64_t ldc) {
  static_assert(kMr == 6, "one case per row count");
  switch (rows) {
    case 6:
      return MicroKernel<6, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
    case 5:
      return MicroKernel<5, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
    case 4:
      return MicroKernel<4, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
    case 3:
      return MicroKernel<3, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
    case 2:
      return MicroKernel<2, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
    default:
      return MicroKernel<1, kAccumulate>(depth, a, a_row, a_depth, b, ldb, c, ldc);
  }
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

// Window of query row i (item-local) under the bottom-right convention, unclamped.
inline int64_t LowestKey(const AttentionParams& p, const ItemExtent& e, int64_t i) {
  return p.window_left == kUnboundedWindow ? std::numeric_limits<int64_t>::min() / 4
                                           : i + e.nk - e.nq - p.window_left;
}
inline int64_t HighestKey(const AttentionParams& p, const ItemExtent& e, int64_t i) {
  return p.window_right == kUnboundedWindow ? std::numeric_limits<int64_t>::max() / 4
                                            : i + e.nk - e.nq + p.window_right;
}

KeyRange KeysOfBlock(const AttentionParams& p, const ItemExtent& e, int64_t row0, int64_t rows) {
  return {std::max<int64_t>(0, LowestKey(p, e, row0)),
          std::min<int64_t>(e.nk, HighestKey(p, e, row0 + rows - 1) + 1)};
}

struct WorkItem {
  int64_t batch, head, row0;
  int64_t cost;  // keys the block can see: the sort key for load balancing
};

// Per-thread buffers, sized for one work item at head dim d (d_pad = d rounded up to kNr).
struct Scratch {
  std::vector<float> storage;
  float* qt;  // [d, kBlockM]       Q block transposed, * scale * log2(e); zero beyond its rows
  float* k;   // [kBlockN, d]       K tile as float32 (when K is not float32)
  float* v;   // [kBlockN, d_pad]   V tile as float32, zero beyond d (when V is not read in place)
  float* st;  // [kBlockN, kBlockM] scores transposed, then probabilities
  float* o;   // [kBlockM, d_pad]   unnormalised output
  float* m;   // [kBlockM]          running row max (log2 domain)
  float* l;   // [kBlockM]          running row sum
  float* alpha;  // [kBlockM]          this tile's rescale factor exp2(m_old - m_new)
  float* row;    // [d]                one converted row

  void Prepare(int64_t d, int64_t d_pad) {
    constexpr int64_t kAlign = 16;  // floats: every buffer starts on a 64-byte boundary
    const int64_t sizes[] = {d * kBlockM,       kBlockN * d,     kBlockN * d_pad,
                             kBlockN * kBlockM, kBlockM * d_pad, kBlockM,
                             kBlockM,           kBlockM,         d};
    float** buffers[] = {&qt, &k, &v, &st, &o, &m, &l, &alpha, &row};
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

// The hot function in three builds, picked at load time by an ifunc resolver. ThreadSanitizer
// builds use the baseline one alone: GCC instruments the resolver, which runs during relocation,
// before the TSan runtime is up.
#if defined(__SANITIZE_THREAD__)
#define ATTENTION_MULTIVERSIONED
#else
#define ATTENTION_MULTIVERSIONED \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

// Computes one work item: rows [row0, row0 + kBlockM) of (batch, head).
ATTENTION_MULTIVERSIONED void ComputeBlock(
    const AttentionParams& p, const WorkItem& item, Scratch& scratch) {
  const int64_t d = p.head_dim;
  const int64_t d_pad = RoundUp(d, kNr);
  const size_t elem = DTypeSize(p.dtype);
  const ItemExtent e = ExtentOf(p, item.batch);
  const int64_t h = item.head;
  const int64_t hk = h / (p.heads_q / p.heads_kv);
  const int64_t rows = std::min(kBlockM, e.nq - item.row0);
  const int64_t cols = RoundUp(rows, kNr);  // S^T columns computed: rows, padded with zero q
  scratch.Prepare(d, d_pad);
  float* const qt = scratch.qt;
  float* const st = scratch.st;
  float* const o = scratch.o;
  float* const m = scratch.m;
  float* const l = scratch.l;
  float* const alpha = scratch.alpha;

  // qt: [d, kBlockM] <- q block [rows, d], scaled into the exp2 domain.
  const auto* q_base = static_cast<const unsigned char*>(p.q);
  // Only the padding columns [rows, cols) are read besides the rows written below: zeroing the
  // whole [d, kBlockM] block would dominate short blocks (decode steps, N = 8 items).
  for (int64_t x = 0; x < d; ++x) {
    std::fill(qt + x * kBlockM + rows, qt + x * kBlockM + cols, 0.0f);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = item.batch * p.q_batch_stride +
                       (e.q_offset + item.row0 + i) * p.q_row_stride + h * p.q_head_stride;
    ConvertRow(p.dtype, q_base + at * elem, d, p.softmax_scale * kLog2e, scratch.row);
    for (int64_t x = 0; x < d; ++x) qt[x * kBlockM + i] = scratch.row[x];
  }
  std::fill(o, o + rows * d_pad, 0.0f);
  std::fill(m, m + kBlockM, kNegInf);
  std::fill(l, l + kBlockM, 0.0f);

  const KeyRange keys = KeysOfBlock(p, e, item.row0, rows);
  // A tile needs element-wise masking unless every row sees all of it.
  const int64_t all_rows_lo = LowestKey(p, e, item.row0 + rows - 1);
  const int64_t all_rows_hi = HighestKey(p, e, item.row0);
  const bool kv_float32 = p.dtype == DType::kFloat32;
  const bool v_in_place = kv_float32 && d == d_pad;
  const auto* k_base = static_cast<const unsigned char*>(p.k);
  const auto* v_base = static_cast<const unsigned char*>(p.v);
  for (int64_t key0 = keys.begin; key0 < keys.end; key0 += kBlockN) {
    const int64_t kn = std::min(kBlockN, keys.end - key0);
    const int64_t k_at =
        item.batch * p.k_batch_stride + (e.k_offset + key0) * p.k_row_stride + hk * p.k_head_stride;
    const int64_t v_at =
        item.batch * p.v_batch_stride + (e.k_offset + key0) * p.v_row_stride + hk * p.v_head_stride;
    // k: [kn, d] with row stride ldk; v: [kn, d_pad] with row stride ldv.
    const float* k = scratch.k;
    int64_t ldk = d;
    if (kv_float32) {
      k = reinterpret_cast<const float*>(k_base) + k_at;
      ldk = p.k_row_stride;
    } else {
      for (int64_t j = 0; j < kn; ++j) {
        ConvertRow(p.dtype, k_base + (k_at + j * p.k_row_stride) * elem, d, 1.0f,
                   scratch.k + j * d);
      }
    }
    const float* v = scratch.v;
    int64_t ldv = d_pad;
    if (v_in_place) {
      v = reinterpret_cast<const float*>(v_base) + v_at;
      ldv = p.v_row_stride;
    } else {
      for (int64_t j = 0; j < kn; ++j) {
        float* const dst = scratch.v + j * d_pad;
        ConvertRow(p.dtype, v_base + (v_at + j * p.v_row_stride) * elem, d, 1.0f, dst);
        std::fill(dst + d, dst + d_pad, 0.0f);
      }
    }

    // S^T = K Q^T: [kn, cols], log2 domain.
    for (int64_t j = 0; j < kn; j += kMr) {
      for (int64_t c = 0; c < cols; c += kNr) {
        MicroKernelRows<false>(std::min(kMr, kn - j), d, k + j * ldk, ldk, 1, qt + c, kBlockM,
                               st + j * kBlockM + c, kBlockM);
      }
    }

    if (key0 < all_rows_lo || key0 + kn - 1 > all_rows_hi) {
      // Key key0 + j is visible to rows i with LowestKey(i) <= key <= HighestKey(i), i.e. rows
      // [key - (nk - nq) - window_right, key - (nk - nq) + window_left] (block-local below).
      for (int64_t j = 0; j < kn; ++j) {
        const int64_t diag = key0 + j - (e.nk - e.nq) - item.row0;
        const int64_t first = p.window_right == kUnboundedWindow ? 0 : diag - p.window_right;
        const int64_t last = p.window_left == kUnboundedWindow ? cols : diag + p.window_left + 1;
        const int64_t lo = std::clamp<int64_t>(first, 0, cols);
        const int64_t hi = std::clamp<int64_t>(last, lo, cols);
        std::fill(st + j * kBlockM, st + j * kBlockM + lo, kNegInf);
        std::fill(st + j * kBlockM + hi, st + j * kBlockM + cols, kNegInf);
      }
    }

    // Online softmax, 8 rows at a time (columns of S^T): P^T = exp2(S^T - m_new) in place.
    for (int64_t c = 0; c < cols; c += 8) {
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
    for (int64_t i = 0; i < rows; ++i) {
      if (alpha[i] == 1.0f) continue;
      float* const orow = o + i * d_pad;
      const Vec8 a = Splat(alpha[i]);
      for (int64_t x = 0; x < d_pad; x += 8) Store(orow + x, Load(orow + x) * a);
    }

    // O += P V: [rows, d_pad], over the kn keys of the tile (P read from P^T).
    for (int64_t i = 0; i < rows; i += kMr) {
      for (int64_t c = 0; c < d_pad; c += kNr) {
        MicroKernelRows<true>(std::min(kMr, rows - i), kn, st + i, 1, kBlockM, v + c, ldv,
                              o + i * d_pad + c, d_pad);
      }
    }
  }

  // o = O / l in the output dtype; rows that saw no key get o = 0, lse = -inf.
  auto* o_base = static_cast<unsigned char*>(p.o);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = e.q_offset + item.row0 + i;
    void* const dst =
        o_base +
        (item.batch * p.o_batch_stride + row * p.o_row_stride + h * p.o_head_stride) * elem;
    StoreRow(o + i * d_pad, d, l[i] > 0.0f ? 1.0f / l[i] : 0.0f, p.dtype, dst);
    if (p.lse != nullptr) {
      p.lse[item.batch * p.lse_batch_stride + h * p.lse_head_stride + row] =
          l[i] > 0.0f ? (m[i] + std::log2(l[i])) * kLn2 : kNegInf;
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

// One Forward call's items, claimed by whichever threads join in.
struct Job {
  const AttentionParams* params = nullptr;
  std::vector<WorkItem> items;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

}  // namespace

struct CpuBackend::Impl {
  int threads = 1;
  std::mutex mu;
  std::condition_variable has_work;
  std::deque<std::shared_ptr<Job>> jobs;  // jobs with items left to claim
  bool stop = false;
  std::vector<std::thread> workers;

  // Claims and computes items of `job` until none are left.
  static void Work(Job& job) {
    thread_local Scratch scratch;
    for (size_t i; (i = job.next.fetch_add(1)) < job.items.size();) {
      ComputeBlock(*job.params, job.items[i], scratch);
      if (job.done.fetch_add(1) + 1 == job.items.size()) {
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
  if (absl::Status status = CheckParams(p); !status.ok()) return status;
  if (p.is_varlen()) {
    if (absl::Status status = CheckVarlen(p); !status.ok()) return status;
  }

  auto job = std::make_shared<Job>();
  job->params = &p;
  for (int64_t b = 0; b < p.batch; ++b) {
    const ItemExtent e = ExtentOf(p, b);
    for (int64_t row0 = 0; row0 < e.nq; row0 += kBlockM) {
      const KeyRange keys = KeysOfBlock(p, e, row0, std::min(kBlockM, e.nq - row0));
      for (int64_t h = 0; h < p.heads_q; ++h) {
        job->items.push_back({b, h, row0, std::max<int64_t>(0, keys.end - keys.begin)});
      }
    }
  }
  if (job->items.empty()) return absl::OkStatus();
  // Longest first, so the last items to finish are short ones (causal blocks differ up to N/64x).
  std::stable_sort(job->items.begin(), job->items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const bool share = !impl_->workers.empty() && job->items.size() > 1;
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
    job->all_done.wait(lock, [&] { return job->done.load() == job->items.size(); });
  }
  return absl::OkStatus();
}

}  // namespace attention::cpu
