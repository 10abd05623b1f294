// What the host tier (--kv_host_bytes, server/sessions/session_store.h) adds to a Step: the
// store and pool work of a decode step (Acquire, Reserve and Append of one row, one paged decode
// launch of one query) on a session whose pages are on the host tier, beside the same step on a
// session in the pool, and the anchor, the plain copy rates of the same bytes between pinned
// host memory and the device (the CUDA pool; plain memcpy on the CPU pool) timed in the same run.
//
//   host_tier_bench [--backend=cuda|cpu] [--session_mib=256] [--steps=10] [--page_bytes=524288]
//
// Shape: bfloat16, Hkv 8, D 128, Hq 32 (one query). Three sessions of session_mib each over a
// pool of two and a host tier of two: a step on the least recently used session brings its pages
// back and moves the next coldest session's out (a restore and a spill of session_mib each), so
// its extra latency is set against the host->device and device->host copy of those bytes. One
// JSON line: medians over `steps` steps of each kind, and "extra_ms_per_gib" = (spilled step -
// resident step) / GiB restored beside "anchor_ms_per_gib" = the two copies' ms per GiB.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "kernels/cpu/paged_kv_pool.h"
#include "kernels/paged_kv.h"
#include "kernels/status_macros.h"
#include "server/sessions/session_store.h"
#ifdef ATTENTION_HOST_TIER_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/runtime/paged_kv_pool.h"
#endif

namespace attention {
namespace {

using server::SessionStore;
using Clock = std::chrono::steady_clock;

constexpr KvShape kShape{.dtype = DType::kBFloat16, .heads_kv = 8, .head_dim = 128};
constexpr int64_t kHeadsQ = 32;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Options {
  std::string backend = "cuda";
  int64_t session_mib = 256;
  int steps = 10;
  int64_t page_bytes = 524288;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

absl::StatusOr<std::unique_ptr<KvPagePool>> MakePool(const Options& o, int64_t pages) {
#ifdef ATTENTION_HOST_TIER_CUDA
  if (o.backend == "cuda") return cuda::MakeKvPagePool(0, pages, o.page_bytes);
#endif
  if (o.backend == "cpu") return cpu::MakeKvPagePool(pages, o.page_bytes, 0);
  return absl::InvalidArgumentError("--backend: expected cpu or cuda (in a CUDA build), got " +
                                    o.backend);
}

// The anchor: ms per GiB of one copy of `bytes` host->device and device->host (median of 5),
// pinned host memory and the pool's device; on the CPU, memcpy between two buffers.
absl::StatusOr<std::pair<double, double>> CopyMsPerGib(const Options& o, int64_t bytes) {
  std::vector<double> h2d, d2h;
#ifdef ATTENTION_HOST_TIER_CUDA
  if (o.backend == "cuda") {
    void *host = nullptr, *device = nullptr;
    if (cudaHostAlloc(&host, bytes, cudaHostAllocPortable) != cudaSuccess ||
        cudaMalloc(&device, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError("anchor: cannot allocate its buffers");
    }
    std::memset(host, 1, bytes);
    for (int i = 0; i < 6; ++i) {
      for (bool to_device : {true, false}) {
        const auto start = Clock::now();
        cudaMemcpy(to_device ? device : host, to_device ? host : device, bytes,
                   to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
        if (i > 0) (to_device ? h2d : d2h).push_back(Ms(Clock::now() - start));
      }
    }
    cudaFreeHost(host);
    cudaFree(device);
  }
#endif
  if (o.backend == "cpu") {
    std::vector<unsigned char> a(bytes, 1), b(bytes, 2);
    for (int i = 0; i < 6; ++i) {
      for (bool forth : {true, false}) {
        const auto start = Clock::now();
        std::memcpy(forth ? b.data() : a.data(), forth ? a.data() : b.data(), bytes);
        if (i > 0) (forth ? h2d : d2h).push_back(Ms(Clock::now() - start));
      }
    }
  }
  const double gib = static_cast<double>(bytes) / kGiB;
  return std::pair{Median(h2d) / gib, Median(d2h) / gib};
}

// One decode step's store and pool work on session `id`: hold it (bringing it back when it is on
// the host tier), append one row, decode one query over its rows. Its wall time in ms.
absl::StatusOr<double> Step(SessionStore& store, KvPagePool& pool, const std::string& id,
                            const std::vector<uint16_t>& row, const std::vector<uint16_t>& q,
                            std::vector<uint16_t>& o) {
  const auto start = Clock::now();
  ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases, store.Acquire("", {id}));
  SessionStore::Lease& lease = leases.front();
  SessionStore::Lease* held[] = {&lease};
  const int64_t one[] = {1};
  RETURN_IF_ERROR(store.Reserve(held, one));
  RETURN_IF_ERROR(store.Append(lease, KvRows{.k = row.data(),
                                             .v = row.data(),
                                             .rows = 1,
                                             .head_stride = kShape.head_dim,
                                             .row_stride = kShape.head_dim}));
  const int32_t cu[] = {0, 1};
  const auto length = static_cast<int32_t>(lease.length());
  PagedDecodeParams p;
  p.shape = kShape;
  p.heads_q = kHeadsQ;
  p.num_seqs = 1;
  p.q = q.data();
  p.o = o.data();
  p.cu_seqlens_q = cu;
  p.total_q = 1;
  p.max_seqlen_q = 1;
  p.seqlens_k = &length;
  p.max_seqlen_k = length;
  p.page_table = lease.page_table().data();
  p.page_table_stride = static_cast<int64_t>(lease.page_table().size());
  p.softmax_scale = 0.088f;
  RETURN_IF_ERROR(pool.Decode(p).status());
  return Ms(Clock::now() - start);
}

absl::Status Run(const Options& o) {
  const int64_t page_rows = PageRows(o.page_bytes, kShape);
  if (page_rows == 0) return absl::InvalidArgumentError("--page_bytes: too small for the shape");
  const int64_t pages = std::max<int64_t>(1, (o.session_mib << 20) / o.page_bytes);
  // Rows that leave room in the last page for every step's appended row.
  const int64_t rows = pages * page_rows - o.steps * 2 - 1;
  if (rows < 1) return absl::InvalidArgumentError("--session_mib: too small for --steps");
  ASSIGN_OR_RETURN(std::unique_ptr<KvPagePool> pool, MakePool(o, 2 * pages));
  ASSIGN_OR_RETURN(HostBuffer host, pool->AllocateHost(2 * pages * o.page_bytes));
  std::vector<double> restores;
  SessionStore store(
      {{.name = o.backend,
        .pool = pool.get(),
        .host_tier = host,
        .host_tier_bytes = 2 * pages * o.page_bytes}},
      {.on_host_tier = [&restores](const std::string&, const server::HostTierMove& move) {
        if (move.restored_pages > 0) restores.push_back(move.restore_seconds * 1e3);
      }});
  // bfloat16 1.0 everywhere: the values do not change what the copies and the kernel move.
  const std::vector<uint16_t> kv(kShape.heads_kv * rows * kShape.head_dim, 0x3f80);
  const std::vector<uint16_t> row(kShape.heads_kv * kShape.head_dim, 0x3f80);
  const std::vector<uint16_t> q(kHeadsQ * kShape.head_dim, 0x3f80);
  std::vector<uint16_t> out(q.size());
  std::vector<std::string> ids;
  for (int s = 0; s < 3; ++s) {
    ASSIGN_OR_RETURN(SessionStore::Lease lease, store.Create("", kShape, rows, 0));
    RETURN_IF_ERROR(store.Append(lease, KvRows{.k = kv.data(),
                                               .v = kv.data(),
                                               .rows = rows,
                                               .head_stride = rows * kShape.head_dim,
                                               .row_stride = kShape.head_dim}));
    ids.push_back(lease.id());
  }
  // Round robin: each session stepped is the least recently used one, on the host tier; stepped
  // again at once, it is in the pool.
  std::vector<double> spilled, resident;
  for (int i = 0; i < o.steps + 1; ++i) {
    const std::string& id = ids[i % 3];
    ASSIGN_OR_RETURN(const double cold, Step(store, *pool, id, row, q, out));
    ASSIGN_OR_RETURN(const double warm, Step(store, *pool, id, row, q, out));
    if (i == 0) continue;  // warm-up
    spilled.push_back(cold);
    resident.push_back(warm);
  }
  const int64_t session_bytes = pages * o.page_bytes;
  const double gib = static_cast<double>(session_bytes) / kGiB;
  ASSIGN_OR_RETURN(const auto anchor, CopyMsPerGib(o, session_bytes));
  const double extra = Median(spilled) - Median(resident);
  std::printf(
      "{\"backend\": \"%s\", \"page_bytes\": %lld, \"session_bytes\": %lld, \"steps\": %d, "
      "\"step_spilled_ms\": %.3f, \"step_resident_ms\": %.3f, \"restore_ms\": %.3f, "
      "\"extra_ms_per_gib\": %.2f, \"h2d_ms_per_gib\": %.2f, \"d2h_ms_per_gib\": %.2f, "
      "\"anchor_ms_per_gib\": %.2f}\n",
      o.backend.c_str(), static_cast<long long>(o.page_bytes),
      static_cast<long long>(session_bytes), o.steps, Median(spilled), Median(resident),
      Median(restores), extra / gib, anchor.first, anchor.second, anchor.first + anchor.second);
  return absl::OkStatus();
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  attention::Options o;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    bool ok = false;
    if (absl::StartsWith(arg, "--backend=")) {
      o.backend = std::string(arg.substr(10));
      ok = true;
    } else if (absl::StartsWith(arg, "--session_mib=")) {
      ok = absl::SimpleAtoi(arg.substr(14), &o.session_mib);
    } else if (absl::StartsWith(arg, "--steps=")) {
      ok = absl::SimpleAtoi(arg.substr(8), &o.steps) && o.steps > 0;
    } else if (absl::StartsWith(arg, "--page_bytes=")) {
      ok = absl::SimpleAtoi(arg.substr(13), &o.page_bytes);
    }
    if (!ok) {
      std::fprintf(stderr, "host_tier_bench: unknown or bad flag %s\n", argv[i]);
      return 2;
    }
  }
  if (absl::Status status = attention::Run(o); !status.ok()) {
    std::fprintf(stderr, "host_tier_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
