// The CPU backend's paged KV pool: pages in one anonymous mapping (committed by the OS page by
// page as rows are written), and decode steps as split-KV work items on a small thread pool.
//
// A decode work item is (sequence, kv head, key split). It converts the queries of every query
// head of its kv head ([Hq/Hkv x Nq_s, D], scaled by softmax_scale * log2(e) so the softmax runs
// on exp2) to float32 once, then walks its keys in tiles of up to kTileKeys rows that stay within
// one page: each tile's K and V rows are converted to float32 once and serve all of those query
// rows (the point of grouping: one read of K/V per kv head), logits are masked per row
// (bottom-right aligned window, within the diagonal key's chunk with a chunk size; softcapped
// first with a softcap), and the online softmax keeps a running max m and sum l per row; sinks
// join l when o is written, or when the splits merge.
// With one split the item writes o and lse itself; with several, each writes a normalised float32
// partial and its log2-sum-exp, and the partials are merged by LSE afterwards (o = sum_s w_s o_s /
// sum_s w_s with w_s = 2^(lse_s - max lse)).
#include "kernels/cpu/paged_kv_pool.h"

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/vec8.h"
#include "kernels/dtype_convert.h"
#include "kernels/paged_kv_host.h"
#include "kernels/status_macros.h"

namespace attention::cpu {
namespace {

constexpr int64_t kTileKeys = 64;       // keys per K/V tile
constexpr int64_t kMinSplitKeys = 512;  // fewer keys per split cost more in merging than they gain
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// dst[0, n) = float(src[0, n)) * scale, dst[n, n_pad) = 0.
void ConvertPaddedRow(DType dtype, const void* src, int64_t n, int64_t n_pad, float scale,
                      float* dst) {
  ConvertRow(dtype, src, n, scale, dst);
  std::fill(dst + n, dst + n_pad, 0.0f);
}

// Runs fn(i) for i in [0, n) on `threads` threads (the caller and threads - 1 workers). One
// ParallelFor at a time (the pool's Decode holds its mutex around it).
class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_ = 0;
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
  }

 private:
  void Drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < n_;) (*fn_)(i);
  }
  void WorkerLoop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      lock.unlock();
      Drain();
      lock.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// One decode step as seen by its work items.
struct DecodeJob {
  const PagedDecodeParams* p;
  const unsigned char* pool;
  int64_t page_bytes, page_rows;
  int64_t splits, split_keys;
  // splits > 1: [splits, Hq * total_q, Dv] normalised partial o and [splits, Hq * total_q]
  // log2-sum-exp.
  float* part_o;
  float* part_lse;
};

// Per-thread buffers (d_pad, dv_pad = the QK and V head dims rounded up to 8): q and k rows of
// d_pad, v and o rows of dv_pad.
struct Scratch {
  std::vector<float> q, o, m, l, k, v, s;
  void Prepare(int64_t rows, int64_t d_pad, int64_t dv_pad) {
    q.resize(rows * d_pad);
    o.assign(rows * dv_pad, 0.0f);
    m.assign(rows, kNegInf);
    l.assign(rows, 0.0f);
    k.resize(kTileKeys * d_pad);
    v.resize(kTileKeys * dv_pad);
    s.resize(kTileKeys);
  }
};

// Compiled for x86-64-v3 (AVX2 + FMA) and baseline x86-64, picked at load time, as the CPU
// backend's hot function (cpu_attention.cc; ThreadSanitizer builds take the baseline alone).
// Query head h's sink in the log2 domain; -inf without sinks.
inline float SinkLog2(const PagedDecodeParams& p, int64_t h) {
  return p.sinks != nullptr ? p.sinks[h] * kLog2e : kNegInf;
}

// Adds a sink logit s2 (log2 domain) to a row's max m and sum l: with m' = max(m, s2),
// l = l 2^(m - m') + 2^(s2 - m'), and the row's unnormalised o scales by o_scale = 2^(m - m').
inline void AddSink(float s2, float& m, float& l, float& o_scale) {
  if (s2 == kNegInf) return;
  if (s2 > m) {
    o_scale = std::exp2(m - s2);  // 0 for a row that saw no key (m = -inf)
    l = l * o_scale + 1.0f;
    m = s2;
  } else {
    l += std::exp2(s2 - m);
  }
}

#if defined(__SANITIZE_THREAD__)
#define ATTENTION_PAGED_MULTIVERSIONED
#else
#define ATTENTION_PAGED_MULTIVERSIONED __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
ATTENTION_PAGED_MULTIVERSIONED void DecodeItem(const DecodeJob& job, int64_t item, Scratch& sc) {
  const PagedDecodeParams& p = *job.p;
  const KvShape& shape = p.shape;
  const int64_t hkv = shape.heads_kv, d = shape.head_dim, d_pad = RoundUp(d, 8);
  const int64_t dv = shape.value_head_dim(), dv_pad = RoundUp(dv, 8);
  const int64_t seq = item / (hkv * job.splits);
  const int64_t hk = item / job.splits % hkv;
  const int64_t split = item % job.splits;
  const int64_t group = p.heads_q / hkv;
  const int64_t q0 = p.cu_seqlens_q[seq], nq = p.cu_seqlens_q[seq + 1] - q0;
  const int64_t nk = p.seqlens_k[seq];
  const int64_t rows = group * nq;  // row r: query head hk * group + r % group, query r / group
  if (rows == 0) return;
  const size_t elem = DTypeSize(shape.dtype);
  // Element offset of row r in q (times d), o (times dv) and lse.
  auto row_index = [&](int64_t r) {
    return p.heads_q * q0 + (hk * group + r % group) * nq + r / group;
  };
  sc.Prepare(rows, d_pad, dv_pad);
  for (int64_t r = 0; r < rows; ++r) {
    ConvertPaddedRow(shape.dtype, static_cast<const unsigned char*>(p.q) + row_index(r) * d * elem,
                     d, d_pad, p.softmax_scale * kLog2e, sc.q.data() + r * d_pad);
  }

  // Query i sees keys VisibleKeys(i + diag) (its window, within its chunk); the item's keys are
  // the union over its queries, cut to its split.
  const int64_t diag = nk - nq;
  const auto row_keys = [&](int64_t i) {
    return VisibleKeys(i + diag, p.window_left, p.window_right, p.chunk_size);
  };
  int64_t lo = split * job.split_keys, hi = std::min(nk, lo + job.split_keys);
  lo = std::max(lo, row_keys(0).lo);
  hi = std::min(hi, row_keys(nq - 1).hi + 1);
  // Softcapping in the log2 domain: c tanh(s / c) on natural-log logits is c2 tanh(s2 / c2).
  const float softcap2 = p.softcap * kLog2e;
  for (int64_t key0 = lo; key0 < hi;) {
    const int64_t page_row = key0 % job.page_rows;
    const int64_t kn = std::min({kTileKeys, hi - key0, job.page_rows - page_row});
    const unsigned char* page =
        job.pool + p.page_table[seq * p.page_table_stride + key0 / job.page_rows] * job.page_bytes;
    const unsigned char* k_rows = page + KvRowOffset(shape, job.page_rows, hk, page_row);
    const unsigned char* v_rows = page + VRowOffset(shape, job.page_rows, hk, page_row);
    for (int64_t j = 0; j < kn; ++j) {
      ConvertPaddedRow(shape.dtype, k_rows + j * d * elem, d, d_pad, 1.0f, sc.k.data() + j * d_pad);
      ConvertPaddedRow(shape.dtype, v_rows + j * shape.v_row_pitch() * elem, dv, dv_pad, 1.0f,
                       sc.v.data() + j * dv_pad);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const RowKeys keys = row_keys(r / group);
      const int64_t jlo = std::clamp<int64_t>(keys.lo - key0, 0, kn);
      const int64_t jhi = std::clamp<int64_t>(keys.hi + 1 - key0, jlo, kn);
      if (jlo >= jhi) continue;
      const float* q = sc.q.data() + r * d_pad;
      float mx = sc.m[r];
      for (int64_t j = jlo; j < jhi; ++j) {
        const float* k = sc.k.data() + j * d_pad;
        Vec8 acc{};
        for (int64_t x = 0; x < d_pad; x += 8) acc += Load(q + x) * Load(k + x);
        sc.s[j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        if (p.softcap > 0.0f) sc.s[j] = softcap2 * std::tanh(sc.s[j] / softcap2);
        mx = std::max(mx, sc.s[j]);
      }
      const float alpha = std::exp2(sc.m[r] - mx);  // 0 while the row has seen no key (m = -inf)
      float sum = 0.0f;
      for (int64_t j = jlo; j < jhi; ++j) {
        sc.s[j] = std::exp2(sc.s[j] - mx);
        sum += sc.s[j];
      }
      // o = o * alpha + P V, 8 columns at a time over the tile's keys (o stays in a register).
      float* o = sc.o.data() + r * dv_pad;
      for (int64_t x = 0; x < dv_pad; x += 8) {
        Vec8 acc = Load(o + x) * alpha;
        for (int64_t j = jlo; j < jhi; ++j) acc += sc.s[j] * Load(sc.v.data() + j * dv_pad + x);
        Store(o + x, acc);
      }
      sc.l[r] = sc.l[r] * alpha + sum;
      sc.m[r] = mx;
    }
    key0 += kn;
  }

  // Rows that saw no key: o = 0, lse = -inf. With one split the sink (SinkLog2) joins l here,
  // with several when the splits merge.
  for (int64_t r = 0; r < rows; ++r) {
    float l = sc.l[r], m = sc.m[r], o_scale = 1.0f;
    if (job.splits == 1 && p.sinks != nullptr) {
      AddSink(SinkLog2(p, hk * group + r % group), m, l, o_scale);
    }
    const float inv = l > 0.0f ? o_scale / l : 0.0f;
    const float lse2 = l > 0.0f ? m + std::log2(l) : kNegInf;
    const float* o = sc.o.data() + r * dv_pad;
    const int64_t at = row_index(r);
    if (job.splits == 1) {
      StoreRow(o, dv, inv, shape.dtype, static_cast<unsigned char*>(p.o) + at * dv * elem);
      if (p.lse != nullptr) p.lse[at] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
    } else {
      const int64_t part = split * p.heads_q * p.total_q + at;
      for (int64_t x = 0; x < dv; ++x) job.part_o[part * dv + x] = o[x] * inv;
      job.part_lse[part] = lse2;
    }
  }
}

// The query head of row r of o and lse: sequence s's rows start at Hq * cu_seqlens_q[s], [Hq,
// Nq_s].
int64_t HeadOfRow(const PagedDecodeParams& p, int64_t r) {
  const int32_t* cu = p.cu_seqlens_q;
  const int64_t s = std::upper_bound(cu, cu + p.num_seqs + 1, r / p.heads_q) - cu - 1;
  return (r - p.heads_q * cu[s]) / (cu[s + 1] - cu[s]);
}

// Merges the splits of rows [first, last) of o and lse by their log2-sum-exp (and the sinks).
void MergeSplits(const DecodeJob& job, int64_t first, int64_t last) {
  const PagedDecodeParams& p = *job.p;
  const int64_t d = p.shape.value_head_dim(), stride = p.heads_q * p.total_q;
  std::vector<float> acc(d);
  for (int64_t r = first; r < last; ++r) {
    float mx = kNegInf;
    for (int64_t s = 0; s < job.splits; ++s) mx = std::max(mx, job.part_lse[s * stride + r]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float sum = 0.0f;
    if (mx != kNegInf) {
      for (int64_t s = 0; s < job.splits; ++s) {
        const float w = std::exp2(job.part_lse[s * stride + r] - mx);
        if (w == 0.0f) continue;
        sum += w;
        const float* o = job.part_o + (s * stride + r) * d;
        for (int64_t x = 0; x < d; ++x) acc[x] += w * o[x];
      }
    }
    float o_scale = 1.0f;
    if (p.sinks != nullptr) AddSink(SinkLog2(p, HeadOfRow(p, r)), mx, sum, o_scale);
    const float inv = sum > 0.0f ? o_scale / sum : 0.0f;
    StoreRow(acc.data(), d, inv, p.shape.dtype,
             static_cast<unsigned char*>(p.o) + r * d * DTypeSize(p.shape.dtype));
    if (p.lse != nullptr) p.lse[r] = sum > 0.0f ? (mx + std::log2(sum)) * kLn2 : kNegInf;
  }
}

int UsableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

class CpuKvPagePool : public KvPagePool {
 public:
  CpuKvPagePool(unsigned char* memory, int64_t num_pages, int64_t page_bytes, int threads)
      : memory_(memory),
        num_pages_(num_pages),
        page_bytes_(page_bytes),
        threads_(threads),
        workers_(threads) {}
  ~CpuKvPagePool() override { munmap(memory_, num_pages_ * page_bytes_); }

  int64_t page_bytes() const override { return page_bytes_; }
  int64_t num_pages() const override { return num_pages_; }

  // Rows land in distinct pages per sequence, so concurrent writes of different sequences need no
  // lock; the caller orders a sequence's writes before the decode steps that read them.
  absl::Status Write(absl::Span<const KvWrite> writes) override {
    std::vector<int64_t> page_rows;
    for (const KvWrite& w : writes) {
      RETURN_IF_ERROR(RefuseDeviceMemory(w.memory, "cpu"));
      ASSIGN_OR_RETURN(const int64_t rows, CheckKvWrite(w, page_bytes_, num_pages_));
      page_rows.push_back(rows);
    }
    for (size_t i = 0; i < writes.size(); ++i) {
      RETURN_IF_ERROR(CopyRows(writes[i], page_rows[i], nullptr));
    }
    return absl::OkStatus();
  }

  // Synchronous: the copies are done when it returns. A destination is a page no sequence reads
  // until the caller has it back (a fresh page), so no lock is needed either.
  absl::Status CopyPages(absl::Span<const std::pair<int32_t, int32_t>> src_dst) override {
    RETURN_IF_ERROR(CheckPageCopies(src_dst, num_pages_));
    for (const auto& [src, dst] : src_dst) {
      std::memcpy(memory_ + dst * page_bytes_, memory_ + src * page_bytes_, page_bytes_);
    }
    return absl::OkStatus();
  }

  // The caller holds the sequence's pages, so no write into them runs meanwhile.
  absl::Status Read(const KvRead& read) override {
    const KvWrite w = AsKvWrite(read);
    ASSIGN_OR_RETURN(const int64_t page_rows, CheckKvWrite(w, page_bytes_, num_pages_));
    return CopyRows(w, page_rows, &read);
  }

  // The host tier in plain host memory, mapped as the pool is (committed only as pages land in
  // it). Copies are plain and synchronous: the caller (the session store) holds the pages, so no
  // write or step touches them meanwhile.
  absl::StatusOr<HostBuffer> AllocateHost(int64_t bytes) override {
    void* memory = bytes > 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                             : MAP_FAILED;
    if (memory == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: cannot map ", bytes, " bytes for the KV host tier"));
    }
    return HostBuffer(static_cast<unsigned char*>(memory),
                      [bytes](unsigned char* p) { munmap(p, bytes); });
  }
  absl::Status SavePages(absl::Span<const HostPage> pages) override {
    RETURN_IF_ERROR(CheckHostPages(pages, num_pages_));
    for (const HostPage& p : pages)
      std::memcpy(p.host, memory_ + p.page * page_bytes_, page_bytes_);
    return absl::OkStatus();
  }
  absl::Status LoadPages(absl::Span<const HostPage> pages) override {
    RETURN_IF_ERROR(CheckHostPages(pages, num_pages_));
    for (const HostPage& p : pages)
      std::memcpy(memory_ + p.page * page_bytes_, p.host, page_bytes_);
    return absl::OkStatus();
  }

  absl::StatusOr<KvStepTimes> Decode(const PagedDecodeParams& given) override {
    RETURN_IF_ERROR(RefuseDeviceMemory(given.memory, "cpu"));
    ASSIGN_OR_RETURN(const DecodeExtent extent, CheckPagedDecode(given, page_bytes_, num_pages_));
    if (given.num_seqs == 0 || given.total_q == 0) return KvStepTimes{};
    const auto start = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    const PagedDecodeParams p = Packed(given);
    // Enough items for every thread a few times over, but no split shorter than kMinSplitKeys.
    const int64_t base = p.num_seqs * p.shape.heads_kv;
    const int64_t max_splits = std::max<int64_t>(1, extent.max_seqlen_k / kMinSplitKeys);
    const int64_t splits = std::clamp<int64_t>((4 * threads_ + base - 1) / base, 1, max_splits);
    DecodeJob job{.p = &p,
                  .pool = memory_,
                  .page_bytes = page_bytes_,
                  .page_rows = extent.page_rows,
                  .splits = splits,
                  .split_keys = (extent.max_seqlen_k + splits - 1) / splits,
                  .part_o = nullptr,
                  .part_lse = nullptr};
    const int64_t rows = p.heads_q * p.total_q;
    if (splits > 1) {
      part_o_.resize(splits * rows * p.shape.value_head_dim());
      part_lse_.resize(splits * rows);
      job.part_o = part_o_.data();
      job.part_lse = part_lse_.data();
    }
    workers_.ParallelFor(base * splits, [&job](int64_t item) {
      thread_local Scratch scratch;
      // Once stopped, the remaining items (one sequence, kv head and split each) are skipped.
      if (!StopRequested(job.p->stop)) DecodeItem(job, item, scratch);
    });
    if (StopRequested(p.stop)) return StoppedError();
    if (splits > 1) {
      const int64_t first = p.heads_q * p.cu_seqlens_q[0];
      const int64_t chunk = 64;
      workers_.ParallelFor((rows - first + chunk - 1) / chunk, [&](int64_t c) {
        MergeSplits(job, first + c * chunk, std::min(rows, first + (c + 1) * chunk));
      });
    }
    if (Gathers(given)) ScatterDecodeOutputs(given, p.o, p.lse);
    KvStepTimes times;
    times.compute_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    return times;
  }

 private:
  // Whether a step's q is gathered into this pool's buffers (and o and lse scattered back): it
  // comes per sequence, and is not one sequence whose own buffers are the packed layout.
  static bool Gathers(const PagedDecodeParams& p) {
    return p.q_seqs != nullptr && !(p.num_seqs == 1 && p.cu_seqlens_q[0] == 0);
  }

  // The step with q, o and lse packed, as the kernels read them: as given, one sequence's own
  // buffers, or q gathered into this pool's buffers, where o and lse are written, then scattered
  // by Decode (Gathers). Under mu_.
  PagedDecodeParams Packed(const PagedDecodeParams& given) {
    PagedDecodeParams p = given;
    if (given.q_seqs == nullptr) return p;
    p.q_seqs = nullptr;
    p.o_seqs = nullptr;
    p.lse_seqs = nullptr;
    if (!Gathers(given)) {
      p.q = given.q_seqs[0];
      p.o = given.o_seqs[0];
      p.lse = given.lse_seqs != nullptr ? given.lse_seqs[0] : nullptr;
      return p;
    }
    const size_t rows = p.heads_q * p.total_q;
    const size_t elem = DTypeSize(p.shape.dtype);
    q_packed_.resize(rows * p.shape.head_dim * elem);
    o_packed_.resize(rows * p.shape.value_head_dim() * elem);
    GatherDecodeQ(given, q_packed_.data());
    p.q = q_packed_.data();
    p.o = o_packed_.data();
    if (given.lse_seqs != nullptr) {
      lse_packed_.resize(rows);
      p.lse = lse_packed_.data();
    }
    return p;
  }

  // One checked write (page_rows from CheckKvWrite) of w's rows into the pages, or with `read`
  // (w = AsKvWrite(*read)) the same rows out of the pages into read->k and read->v. K rows are D
  // elements, V rows Dv, at v's strides (VStride); none where V lies in K's rows (v_from_k).
  absl::Status CopyRows(const KvWrite& w, int64_t page_rows, const KvRead* read) {
    const KvShape& shape = w.shape;
    const int64_t elem = static_cast<int64_t>(DTypeSize(shape.dtype));
    const int64_t k_row_bytes = shape.head_dim * elem;
    const int64_t v_row_bytes = shape.value_head_dim() * elem;
    const int64_t v_head_stride = VStride(shape, w.head_stride);
    const int64_t v_row_stride = VStride(shape, w.row_stride);
    // Copies `bytes` from host to page, or with `read` from page to the same offset of host_out.
    const auto copy = [&](unsigned char* page, const void* host, void* host_out, int64_t offset,
                          int64_t bytes) {
      if (read == nullptr) {
        std::memcpy(page, static_cast<const unsigned char*>(host) + offset, bytes);
      } else {
        std::memcpy(static_cast<unsigned char*>(host_out) + offset, page, bytes);
      }
    };
    void* k_out = read != nullptr ? read->k : nullptr;
    void* v_out = read != nullptr ? read->v : nullptr;
    return ForEachPageRun(w, page_rows, [&](const PageRun& run) {
      unsigned char* page = memory_ + run.page * page_bytes_;
      for (int64_t h = 0; h < shape.heads_kv; ++h) {
        unsigned char* k_dst = page + KvRowOffset(shape, page_rows, h, run.page_row);
        unsigned char* v_dst = page + VRowOffset(shape, page_rows, h, run.page_row);
        for (int64_t j = 0; j < run.count; ++j) {
          const int64_t row = run.src_row + j;
          copy(k_dst + j * k_row_bytes, w.k, k_out, (h * w.head_stride + row * w.row_stride) * elem,
               k_row_bytes);
          if (KvParts(shape) == 1) continue;  // V in K's rows: nothing of its own
          copy(v_dst + j * v_row_bytes, w.v, v_out, (h * v_head_stride + row * v_row_stride) * elem,
               v_row_bytes);
        }
      }
      return absl::OkStatus();
    });
  }

  unsigned char* const memory_;
  const int64_t num_pages_, page_bytes_;
  const int threads_;
  std::mutex mu_;  // one decode step at a time: the workers and the partial buffers are shared
  WorkerPool workers_;
  std::vector<float> part_o_, part_lse_;
  std::vector<unsigned char> q_packed_, o_packed_;  // Packed's buffers
  std::vector<float> lse_packed_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvPagePool>> MakeKvPagePool(int64_t num_pages, int64_t page_bytes,
                                                           int threads) {
  if (num_pages <= 0 || page_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_pages and page_bytes must be positive, got ", num_pages, " and ", page_bytes));
  }
  const int64_t bytes = num_pages * page_bytes;
  void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (memory == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot map ", bytes, " bytes for the KV pool"));
  }
  return std::unique_ptr<KvPagePool>(new CpuKvPagePool(static_cast<unsigned char*>(memory),
                                                       num_pages, page_bytes,
                                                       threads > 0 ? threads : UsableCpus()));
}

}  // namespace attention::cpu
