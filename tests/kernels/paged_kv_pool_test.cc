// A KvPagePool (kernels/paged_kv.h) against the float64 reference (kernels/reference): sequences
// of ragged lengths written into shuffled pages (in chunks, from BHSD or BSHD rows), then one
// decode step over all of them, compared per sequence with attention over its contiguous K/V.
// Outputs are poisoned with NaN first; page-table entries past a sequence's pages hold -1, so a
// kernel that reads past its keys reads outside the pool. Fresh random inputs each run (seed
// printed on failure; ATTENTION_TEST_SEED reruns one).
#include "tests/kernels/paged_kv_pool_test.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype_convert.h"
#include "kernels/reference/reference_attention.h"

namespace attention::kernel_test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// What a failure message says of a test's inputs: its dtype and how to rerun it on them.
std::string SeedHint(DType dtype, uint64_t seed) {
  return absl::StrCat(DTypeName(dtype), " seed=", seed, " (rerun with ATTENTION_TEST_SEED=", seed,
                      ")");
}

uint64_t NextSeed() {
  if (const char* env = std::getenv("ATTENTION_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

struct DecodeCase {
  std::string name;
  int64_t heads_q = 4;
  int64_t heads_kv = 1;
  int64_t head_dim = 64;
  int64_t v_head_dim = 0;   // Dv, of v and o; 0: head_dim
  bool v_from_k = false;    // v is k's first Dv features, kept once (MLA's latent cache)
  std::vector<int32_t> nq;  // per sequence: queries of this step
  std::vector<int32_t> nk;  // per sequence: keys (including this step's)
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  std::optional<float> softmax_scale;  // absent: 1 / sqrt(head_dim)
  // Open-model options: per query head sink logits (empty: none), a softcap, a chunk size.
  std::vector<float> sinks;
  float softcap = 0.0f;
  int64_t chunk_size = 0;
  bool return_lse = true;
  int64_t page_rows = 32;  // the pool's pages hold this many rows of the case's shape
  Layout write_layout = Layout::kBHSD;
  int64_t write_chunk = 0;  // rows per Write; 0: chunks of random sizes
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

int64_t ValueDim(const DecodeCase& c) { return c.v_head_dim > 0 ? c.v_head_dim : c.head_dim; }
KvShape ShapeOf(const DecodeCase& c, DType dtype) {
  return {dtype, c.heads_kv, c.head_dim, ValueDim(c), c.v_from_k};
}

std::vector<DecodeCase> Cases() {
  std::vector<DecodeCase> cases;
  DecodeCase c;
  // Lengths around tiles and pages (page_rows 32: 31, 33; 64 = key tile), primes.
  c.name = "ragged_lengths_gqa4";
  c.nq = std::vector<int32_t>(12, 1);
  c.nk = {1, 15, 16, 17, 31, 32, 33, 63, 65, 97, 129, 257};
  cases.push_back(c);

  c = {};
  c.name = "gqa1_d128_bshd";
  c.heads_q = c.heads_kv = 4;
  c.head_dim = 128;
  c.nq = {1, 1};
  c.nk = {100, 1000};
  c.write_layout = Layout::kBSHD;
  c.page_rows = 64;
  cases.push_back(c);

  c = {};
  c.name = "gqa8_d128";
  c.heads_q = 16;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.nq = {1, 1, 1};
  c.nk = {129, 700, 64};
  cases.push_back(c);

  c = {};
  c.name = "mqa_d64_nolse";
  c.heads_q = 8;
  c.heads_kv = 1;
  c.nq = {1, 1};
  c.nk = {333, 47};
  c.return_lse = false;
  c.page_rows = 16;
  cases.push_back(c);

  // Several queries per sequence (extend steps): 16-row blocks of group x Nq rows, causal.
  c = {};
  c.name = "nq_causal_gqa4";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.nq = {4, 7, 1, 16};
  c.nk = {50, 300, 64, 16};
  c.window_right = 0;
  c.write_layout = Layout::kBSHD;
  cases.push_back(c);

  // Fewer keys than queries: the first queries see no key (o = 0, lse = -inf).
  c = {};
  c.name = "nq_gt_nk_causal";
  c.heads_q = 2;
  c.heads_kv = 1;
  c.nq = {5, 3};
  c.nk = {3, 40};
  c.window_right = 0;
  cases.push_back(c);

  c = {};
  c.name = "window_left_causal";
  c.heads_q = 4;
  c.heads_kv = 2;
  c.nq = {3, 1, 2};
  c.nk = {500, 90, 37};
  c.window_left = 37;
  c.window_right = 0;
  cases.push_back(c);

  c = {};
  c.name = "window_both_neg_scale";
  c.heads_q = 4;
  c.heads_kv = 1;
  c.nq = {5, 9};
  c.nk = {200, 61};
  c.window_left = 5;
  c.window_right = 3;
  c.softmax_scale = -0.11f;
  cases.push_back(c);

  // Head dims without their own tile (zero-filled columns, or the generic path).
  c = {};
  c.name = "d96_d40";
  c.heads_q = 2;
  c.heads_kv = 2;
  c.head_dim = 96;
  c.nq = {1, 2};
  c.nk = {77, 150};
  cases.push_back(c);
  c.name = "d40";
  c.head_dim = 40;
  cases.push_back(c);
  c.name = "d256_d20";
  c.head_dim = 256;
  c.page_rows = 16;
  cases.push_back(c);
  c.name = "d20";
  c.head_dim = 20;
  cases.push_back(c);

  // Open-model options: sinks (one split and several: 1000 keys split), softcap, chunks (a
  // chunk edge inside the extend step's queries), all three with a window.
  c = {};
  c.name = "sinks_gqa4";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.nq = {1, 3, 2};
  c.nk = {1000, 40, 1};
  c.window_right = 0;
  c.sinks = {1.5f, -0.7f, 3.0f, 0.2f, -4.0f, 0.9f, 6.0f, -1.1f};
  cases.push_back(c);
  c.name = "softcap_gqa4";
  c.sinks = {};
  c.softcap = 1.5f;
  c.softmax_scale = 0.5f;
  cases.push_back(c);
  c.name = "chunk_gqa4";
  c.softcap = 0.0f;
  c.softmax_scale.reset();
  c.nq = {5, 4, 1};
  c.nk = {1000, 66, 64};
  c.chunk_size = 32;
  cases.push_back(c);
  c.name = "all_options_window";
  c.window_left = 20;
  c.sinks = {0.5f, -0.5f, 2.0f, 1.0f, 0.0f, -2.0f, 3.5f, 0.7f};
  c.softcap = 3.0f;
  c.chunk_size = 24;
  cases.push_back(c);

  // gpt-oss's sinks at ragged lengths (1, a page +- 1, primes; 1009 keys take several splits),
  // sinks far above a row's lse (o scaled far down, lse the sink's), far below (no effect) and
  // near it; causal extend steps.
  c = {};
  c.name = "sinks_large_small_ragged_causal";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.nq = {1, 1, 1, 1, 2, 1, 3, 1};
  c.nk = {1, 31, 32, 33, 97, 257, 1009, 2};
  c.window_right = 0;
  c.sinks = {25.0f, -25.0f, 9.0f, -9.0f, 6.0f, 0.0f, 2.5f, -80.0f};
  cases.push_back(c);
  // Sinks with a left window that leaves the first queries of a long step no key: they answer
  // o = 0 and lse = their sink.
  c.name = "sinks_window_empty_rows";
  c.heads_q = 4;
  c.heads_kv = 1;
  c.nq = {6, 1};
  c.nk = {3, 200};
  c.window_left = 4;
  c.window_right = 0;
  c.sinks = {1.0f, -3.0f, 12.0f, 0.25f};
  cases.push_back(c);

  // Gemma 2's softcap of 50 and Grok-1's 30, with logits large enough to be capped (unit normal q
  // and k at scales of 2 to 2.5: logits spread over 20 to 32, the largest near the cap): D = 128
  // and D = 64 (tensor-core tiles), D = 256 (Gemma 2's, the SIMT path); ragged lengths, GQA,
  // causal and a left window.
  c = {};
  c.name = "softcap50_ragged_d128_gqa4";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.nq = {1, 1, 1, 1, 1, 1};
  c.nk = {1, 63, 64, 65, 131, 1021};
  c.page_rows = 64;
  c.softcap = 50.0f;
  c.softmax_scale = 2.5f;
  cases.push_back(c);
  c = {};
  c.name = "softcap30_causal_window_d64";
  c.heads_q = 4;
  c.heads_kv = 1;
  c.nq = {2, 5, 1, 1};
  c.nk = {300, 61, 97, 1};
  c.window_left = 50;
  c.window_right = 0;
  c.softcap = 30.0f;
  c.softmax_scale = 2.5f;
  cases.push_back(c);
  c = {};
  c.name = "softcap50_sinks_d256_causal";
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 256;
  c.nq = {1, 3};
  c.nk = {17, 131};
  c.page_rows = 16;
  c.window_right = 0;
  c.softcap = 50.0f;
  c.softmax_scale = 2.0f;
  c.sinks = {60.0f, -1.0f, 45.0f, 0.5f};
  cases.push_back(c);

  // Chunks whose queries' diagonal keys lie before key 0 (Nq > Nk: their chunk holds no key, so
  // they see none, even unwindowed), and a window inside chunks, with sinks.
  c = {};
  c.name = "chunk_nq_gt_nk_sinks";
  c.heads_q = 4;
  c.heads_kv = 2;
  c.nq = {7, 1, 3};
  c.nk = {3, 129, 40};
  c.chunk_size = 2;
  c.sinks = {0.5f, -2.0f, 3.0f, 8.0f};
  cases.push_back(c);
  c.name = "chunk_window_causal_d128";
  c.head_dim = 128;
  c.nq = {9, 1, 4};
  c.nk = {300, 1, 65};
  c.page_rows = 64;
  c.chunk_size = 64;
  c.window_left = 40;
  c.window_right = 0;
  c.sinks = {};
  cases.push_back(c);

  // Long enough for many splits and key tiles per split.
  c = {};
  c.name = "long_5000_gqa4_d128";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.nq = {1, 1};
  c.nk = {5000, 1234};
  c.page_rows = 64;
  cases.push_back(c);

  // Pages of a multiple of the key tile (whole tiles from one page table read) at D = 64.
  c = {};
  c.name = "d64_pages128";
  c.heads_q = 8;
  c.heads_kv = 2;
  c.nq = {1, 2, 1};
  c.nk = {1000, 129, 256};
  c.page_rows = 128;
  cases.push_back(c);

  // V head dims of their own: DeepSeek-V3's expanded MLA (QK 192, V 128; ragged, GQA, causal
  // extend, BSHD writes), Dv > D, and its absorbed decode (one KV head of QK 576 and V 512) with 16
  // and 128 query heads: ragged lengths at pages +- 1, causal extend steps (up to 128 x 3 rows of
  // one KV head), long enough for splits.
  cases.push_back({.name = "mla_d192_dv128_gqa2_causal",
                   .heads_q = 4,
                   .heads_kv = 2,
                   .head_dim = 192,
                   .v_head_dim = 128,
                   .nq = {1, 3, 5, 1},
                   .nk = {1, 17, 70, 130},
                   .window_right = 0,
                   .write_layout = Layout::kBSHD});
  cases.push_back({.name = "d64_dv128_gqa4",
                   .heads_q = 8,
                   .heads_kv = 2,
                   .head_dim = 64,
                   .v_head_dim = 128,
                   .nq = {1, 2},
                   .nk = {33, 300}});
  cases.push_back({.name = "mla_absorbed_d576_dv512",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .nq = {1, 2},
                   .nk = {1100, 33},
                   .window_right = 0,
                   .page_rows = 16});
  cases.push_back({.name = "mla_absorbed_d576_dv512_hq16_ragged",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .nq = {1, 1, 1, 1, 1, 1, 1},
                   .nk = {1, 31, 32, 33, 63, 65, 257},
                   .page_rows = 32});
  cases.push_back({.name = "mla_absorbed_d576_dv512_hq128_causal",
                   .heads_q = 128,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .nq = {1, 3, 1, 2, 1},
                   .nk = {15, 16, 17, 33, 700},
                   .window_right = 0,
                   .page_rows = 16,
                   .write_layout = Layout::kBSHD});
  // The open-model options at MLA's absorbed shape: sinks, a left window and chunks (the CUDA
  // wide tile's epilogue and merge), and a softcap (which the CUDA pool runs on the SIMT kernel).
  cases.push_back({.name = "mla_absorbed_sinks_window_chunk",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .nq = {3, 1, 2},
                   .nk = {300, 65, 1000},
                   .window_left = 100,
                   .window_right = 0,
                   .sinks = {1.5f, -0.7f, 3.0f, 0.2f, -4.0f, 0.9f, 6.0f, -1.1f, 0.0f, 2.0f, -2.0f,
                             4.5f, -3.0f, 1.0f, 0.5f, -0.5f},
                   .chunk_size = 64});
  // MLA's latent cache, V read from K's first 512 features (the CUDA wide tile's instance for it;
  // the SIMT kernel under a softcap): ragged lengths at Hq 16, causal extend at Hq 128, the
  // options.
  cases.push_back({.name = "mla_latent_hq16_ragged",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .v_from_k = true,
                   .nq = {1, 1, 1, 1, 1, 1, 1},
                   .nk = {1, 31, 32, 33, 95, 97, 1000},
                   .page_rows = 32});
  cases.push_back({.name = "mla_latent_hq128_causal",
                   .heads_q = 128,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .v_from_k = true,
                   .nq = {1, 3, 2, 1},
                   .nk = {15, 17, 33, 700},
                   .window_right = 0,
                   .page_rows = 16,
                   .write_layout = Layout::kBSHD});
  cases.push_back({.name = "mla_latent_sinks_window_chunk",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .v_from_k = true,
                   .nq = {3, 1},
                   .nk = {300, 1000},
                   .window_left = 100,
                   .window_right = 0,
                   .sinks = {1.5f, -0.7f, 3.0f, 0.2f, -4.0f, 0.9f, 6.0f, -1.1f, 0.0f, 2.0f, -2.0f,
                             4.5f, -3.0f, 1.0f, 0.5f, -0.5f},
                   .chunk_size = 64});
  cases.push_back({.name = "mla_latent_softcap",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .v_from_k = true,
                   .nq = {1, 2},
                   .nk = {129, 40},
                   .window_right = 0,
                   .softmax_scale = 0.1f,
                   .softcap = 30.0f});
  // V from K where it is all of K (Dv = D, a GQA shape of small head dims: the SIMT kernel).
  cases.push_back({.name = "v_from_k_dv_eq_d_gqa4",
                   .heads_q = 8,
                   .heads_kv = 2,
                   .head_dim = 64,
                   .v_from_k = true,
                   .nq = {1, 4},
                   .nk = {70, 33},
                   .window_right = 0});
  cases.push_back({.name = "mla_absorbed_softcap",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 576,
                   .v_head_dim = 512,
                   .nq = {1, 2},
                   .nk = {129, 40},
                   .window_right = 0,
                   .softmax_scale = 0.1f,
                   .softcap = 30.0f});
  // D = 512 with V of D (the SIMT kernel's wide instance): MQA and GQA, pages +- 1, causal extend.
  cases.push_back({.name = "d512_mqa16_ragged",
                   .heads_q = 16,
                   .heads_kv = 1,
                   .head_dim = 512,
                   .nq = {1, 1, 1, 1},
                   .nk = {15, 16, 17, 600},
                   .page_rows = 16});
  cases.push_back({.name = "d512_gqa4_causal",
                   .heads_q = 8,
                   .heads_kv = 2,
                   .head_dim = 512,
                   .nq = {4, 1, 2},
                   .nk = {40, 31, 129},
                   .window_right = 0,
                   .page_rows = 32});

  c = {};
  c.name = "single_row_writes_100";
  c.heads_q = 4;
  c.heads_kv = 2;
  c.nq = {1};
  c.nk = {100};
  c.write_chunk = 1;
  c.write_layout = Layout::kBSHD;
  cases.push_back(c);
  return cases;
}

double Tolerance(DType dtype) { return dtype == DType::kFloat32 ? 1e-5 : 1e-2; }

std::vector<unsigned char> Encode(const std::vector<float>& x, DType dtype) {
  std::vector<unsigned char> out(x.size() * DTypeSize(dtype));
  for (size_t i = 0; i < x.size(); ++i) StoreFromFloat(out.data(), i, dtype, x[i]);
  return out;
}

// Random standard normal values already rounded to `dtype`, so the reference sees what the pool
// sees.
std::vector<float> RandomRounded(size_t n, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  std::vector<unsigned char> bytes = Encode(x, dtype);
  for (size_t i = 0; i < n; ++i) x[i] = LoadAsFloat(bytes.data(), i, dtype);
  return x;
}

// One sequence: its rows and pages.
struct Sequence {
  std::vector<float> q;        // [Hq, nq, D]
  std::vector<float> k, v;     // [Hkv, nk, D], [Hkv, nk, Dv]
  std::vector<int32_t> pages;  // page_table_stride entries, -1 past its pages
};

// Writes the sequences' K/V (nk[i] rows each) into the pool from BHSD [Hkv, nk, D] or BSHD
// [nk, Hkv, D] host rows (v's with Dv), in rounds: each round's Write takes the next chunk of every
// sequence not yet written in full (as a step appends a token to each of its sessions), `chunk`
// rows (0: random sizes of 1-40 rows per sequence and round). Writes every sequence's K/V in rounds
// of one Write each (`chunk` rows per sequence and round, or random chunks), from host memory, or
// with `device` from device memory (each round's rows behind a recorded ready event).
void WriteSequences(KvPagePool& pool, const KvShape& shape, const std::vector<Sequence>& seqs,
                    const std::vector<int32_t>& nks, Layout layout, int64_t chunk,
                    std::mt19937_64& rng, const PoolDeviceMemory* device = nullptr) {
  const int64_t hkv = shape.heads_kv, d = shape.head_dim;
  // The rows laid out below are of `shape`: a shape that is not the rows' (v of D where they hold
  // Dv) would read and write past them.
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_EQ(seqs[i].k.size(), hkv * nks[i] * d) << "k of sequence " << i << " against the shape";
    ASSERT_EQ(seqs[i].v.size(), hkv * nks[i] * shape.value_head_dim())
        << "v of sequence " << i << " against the shape";
  }
  // V in K's rows (v_from_k): the writes carry k alone (seqs' v, k's first Dv features, is the
  // reference's).
  std::vector<std::vector<unsigned char>> kb, vb;
  // [Hkv, nk, dim] as `layout` lays it out.
  const auto laid_out = [&](const std::vector<float>& x, int64_t nk, int64_t dim) {
    if (layout == Layout::kBHSD) return Encode(x, shape.dtype);
    std::vector<float> out(x.size());
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t r = 0; r < nk; ++r)
        for (int64_t e = 0; e < dim; ++e) out[(r * hkv + h) * dim + e] = x[(h * nk + r) * dim + e];
    return Encode(out, shape.dtype);
  };
  for (size_t i = 0; i < seqs.size(); ++i) {
    kb.push_back(laid_out(seqs[i].k, nks[i], d));
    vb.push_back(laid_out(seqs[i].v, nks[i], shape.value_head_dim()));
  }
  std::vector<void*> on_device;  // [2 * seqs]: each sequence's k, v uploaded (v: none, v_from_k)
  for (size_t i = 0; device != nullptr && i < seqs.size(); ++i) {
    on_device.push_back(device->upload(kb[i].data(), kb[i].size()));
    on_device.push_back(shape.v_from_k ? nullptr : device->upload(vb[i].data(), vb[i].size()));
  }
  void* ready = device != nullptr ? device->recorded_event() : nullptr;
  std::uniform_int_distribution<int64_t> random_chunk(1, 40);
  std::vector<int64_t> written(seqs.size(), 0);
  while (true) {
    std::vector<KvWrite> round;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t nk = nks[i], r0 = written[i];
      if (r0 == nk) continue;
      const int64_t row_stride = layout == Layout::kBHSD ? d : hkv * d;
      KvWrite& w = round.emplace_back();
      w.shape = shape;
      w.page_table = seqs[i].pages.data();
      w.first_row = r0;
      w.rows = std::min(nk - r0, chunk > 0 ? chunk : random_chunk(rng));
      const size_t at = r0 * row_stride * DTypeSize(shape.dtype);
      const size_t v_at = r0 * VStride(shape, row_stride) * DTypeSize(shape.dtype);
      w.k = (device != nullptr ? static_cast<unsigned char*>(on_device[2 * i]) : kb[i].data()) + at;
      w.v = shape.v_from_k ? nullptr
                           : (device != nullptr ? static_cast<unsigned char*>(on_device[2 * i + 1])
                                                : vb[i].data()) +
                                 v_at;
      w.memory = {.on_device = device != nullptr, .ready = ready};
      w.head_stride = layout == Layout::kBHSD ? nk * d : d;
      w.row_stride = row_stride;
      written[i] += w.rows;
    }
    if (round.empty()) break;
    const absl::Status status = pool.Write(round);
    ASSERT_TRUE(status.ok()) << status;
  }
  if (device == nullptr) return;
  device->synchronize(ready);
  for (void* buffer : on_device) {  // after the pool's scatters read them
    if (buffer != nullptr) device->free(buffer);
  }
}

// The reference of one sequence: o [Hq, nq, Dv] and lse [Hq, nq] in float64.
void Reference(const DecodeCase& c, float scale, const Sequence& s, int64_t nq, int64_t nk,
               std::vector<double>* o, std::vector<double>* lse) {
  AttentionParams p;
  p.dtype = DType::kFloat32;  // the values are already rounded to the case's dtype
  p.q = s.q.data();
  p.k = s.k.data();
  p.v = s.v.data();
  p.o = o;  // not written by the reference; must be non-null for CheckParams
  p.batch = 1;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.seqlen_q = nq;
  p.seqlen_k = nk;
  p.head_dim = c.head_dim;
  p.v_head_dim = ValueDim(c);
  p.softmax_scale = scale;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.sinks = c.sinks.empty() ? nullptr : c.sinks.data();
  p.softcap = c.softcap;
  p.chunk_size = c.chunk_size;
  p.SetContiguousStrides(Layout::kBHSD);
  const absl::Status status = reference::Forward(p, o, lse);
  ASSERT_TRUE(status.ok()) << status;
}

// Accumulates ||x - ref||^2 and ||ref||^2 over finite reference values; counts NaN outputs and
// rows that see no key (ref lse -inf) whose output is not exactly 0 / -inf.
struct ErrorSums {
  double err2 = 0, ref2 = 0;
  int64_t nan = 0, bad_empty = 0;
  void Add(double x, double ref) {
    if (std::isnan(x)) {
      ++nan;
      return;
    }
    err2 += (x - ref) * (x - ref);
    ref2 += ref * ref;
  }
  void Expect(const char* what, double tolerance) const {
    EXPECT_EQ(nan, 0) << what << ": elements left NaN";
    EXPECT_EQ(bad_empty, 0) << what << ": rows that see no key must give o = 0, lse = -inf";
    EXPECT_LE(std::sqrt(err2), tolerance * std::sqrt(ref2))
        << what << " relative error " << std::sqrt(err2 / std::max(ref2, 1e-300));
  }
};

struct StepResult {
  std::vector<unsigned char> o;
  std::vector<float> lse;
  absl::Status status;  // Decode's
};

// Runs one decode step of all sequences (queries from s.q) and returns o and lse as written:
// packed, or with each sequence's q, o and lse in buffers of its own (PagedDecodeParams' q_seqs).
// With `device`, q, o and lse are in device memory (StepMemory::on_device); packed, behind the
// caller's ready event and answered by its done event.
StepResult Decode(KvPagePool& pool, const DecodeCase& c, DType dtype, float scale,
                  const std::vector<Sequence>& seqs, int64_t stride, bool per_seq = false,
                  const PoolDeviceMemory* device = nullptr) {
  const int64_t n = static_cast<int64_t>(seqs.size());
  std::vector<int32_t> cu_q{0}, seqlens_k, table;
  std::vector<float> q;
  for (int64_t i = 0; i < n; ++i) {
    cu_q.push_back(cu_q.back() + c.nq[i]);
    seqlens_k.push_back(c.nk[i]);
    q.insert(q.end(), seqs[i].q.begin(), seqs[i].q.end());
    table.insert(table.end(), seqs[i].pages.begin(), seqs[i].pages.end());
  }
  const std::vector<unsigned char> qb = Encode(q, dtype);
  StepResult r;
  r.o = Encode(std::vector<float>(c.heads_q * cu_q.back() * ValueDim(c), kNaN), dtype);
  r.lse.assign(c.return_lse ? c.heads_q * cu_q.back() : 0, kNaN);
  PagedDecodeParams p;
  p.shape = ShapeOf(c, dtype);
  p.heads_q = c.heads_q;
  p.num_seqs = n;
  p.q = qb.data();
  p.o = r.o.data();
  p.lse = c.return_lse ? r.lse.data() : nullptr;
  p.cu_seqlens_q = cu_q.data();
  p.total_q = cu_q.back();
  p.max_seqlen_q = *std::max_element(c.nq.begin(), c.nq.end());
  p.seqlens_k = seqlens_k.data();
  p.max_seqlen_k = *std::max_element(c.nk.begin(), c.nk.end());
  p.page_table = table.data();
  p.page_table_stride = stride;
  p.softmax_scale = scale;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.sinks = c.sinks.empty() ? nullptr : c.sinks.data();
  p.softcap = c.softcap;
  p.chunk_size = c.chunk_size;
  // Per sequence: copies of its q, and o and lse poisoned as the packed ones are.
  const int64_t row_bytes = c.heads_q * c.head_dim * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t o_row_bytes = c.heads_q * ValueDim(c) * static_cast<int64_t>(DTypeSize(dtype));
  std::vector<std::vector<unsigned char>> q_own, o_own;
  std::vector<std::vector<float>> lse_own;
  std::vector<const void*> q_seqs;
  std::vector<void*> o_seqs;
  std::vector<float*> lse_seqs;
  if (per_seq) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t first = cu_q[i], rows = c.nq[i];
      q_own.emplace_back(qb.begin() + first * row_bytes, qb.begin() + (first + rows) * row_bytes);
      o_own.emplace_back(r.o.begin() + first * o_row_bytes,
                         r.o.begin() + (first + rows) * o_row_bytes);
      lse_own.emplace_back(c.return_lse ? c.heads_q * rows : 0, kNaN);
    }
    for (int64_t i = 0; i < n; ++i) {
      q_seqs.push_back(q_own[i].data());
      o_seqs.push_back(o_own[i].data());
      lse_seqs.push_back(lse_own[i].data());
    }
    p.q = nullptr;
    p.o = nullptr;
    p.lse = nullptr;
    p.q_seqs = q_seqs.data();
    p.o_seqs = o_seqs.data();
    p.lse_seqs = c.return_lse ? lse_seqs.data() : nullptr;
  }
  // Device copies of the buffers set above, in the same places of p; outputs come back.
  struct Uploaded {
    void* host;  // an output's, else null
    void* copy;
    size_t bytes;
  };
  std::vector<Uploaded> uploaded;
  auto upload = [&](const void* host, size_t bytes) {
    uploaded.push_back({nullptr, device->upload(host, bytes), bytes});
    return uploaded.back().copy;
  };
  auto upload_output = [&](void* host, size_t bytes) {
    upload(host, bytes);
    uploaded.back().host = host;
    return uploaded.back().copy;
  };
  if (device != nullptr) {
    p.memory.on_device = true;
    if (per_seq) {
      for (int64_t i = 0; i < n; ++i) {
        q_seqs[i] = upload(q_own[i].data(), q_own[i].size());
        o_seqs[i] = upload_output(o_own[i].data(), o_own[i].size());
        if (c.return_lse) {
          lse_seqs[i] = static_cast<float*>(
              upload_output(lse_own[i].data(), lse_own[i].size() * sizeof(float)));
        }
      }
    } else {
      p.q = upload(qb.data(), qb.size());
      p.o = upload_output(r.o.data(), r.o.size());
      if (c.return_lse) {
        p.lse = static_cast<float*>(upload_output(r.lse.data(), r.lse.size() * sizeof(float)));
      }
      p.memory.ready = device->recorded_event();
      p.memory.done = device->new_event();
    }
  }
  const absl::StatusOr<KvStepTimes> times = pool.Decode(p);
  r.status = times.status();
  if (device != nullptr) {
    if (p.memory.done != nullptr) {
      device->synchronize(p.memory.done);
      device->synchronize(p.memory.ready);
    }
    for (const Uploaded& u : uploaded) {
      if (u.host != nullptr) device->download(u.host, u.copy, u.bytes);
      device->free(u.copy);
    }
  }
  EXPECT_TRUE(times.ok()) << times.status();
  for (int64_t i = 0; per_seq && i < n; ++i) {
    std::copy(o_own[i].begin(), o_own[i].end(), r.o.begin() + cu_q[i] * o_row_bytes);
    if (c.return_lse) {
      std::copy(lse_own[i].begin(), lse_own[i].end(), r.lse.begin() + c.heads_q * cu_q[i]);
    }
  }
  return r;
}

// Checks a step's o and lse (Decode of `seqs`) against the float64 reference of each sequence,
// except the rows of the queries for which skip(sequence, query) holds.
void ExpectMatchesReference(
    const DecodeCase& c, DType dtype, float scale, const std::vector<Sequence>& seqs,
    const StepResult& r,
    const std::function<bool(size_t, int64_t)>& skip = [](size_t, int64_t) { return false; }) {
  ErrorSums o_err, lse_err;
  int64_t q_row0 = 0;  // first row (of Hq * total_q) of the sequence
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<double> ref_o, ref_lse;
    Reference(c, scale, seqs[i], c.nq[i], c.nk[i], &ref_o, &ref_lse);
    for (int64_t row = 0; row < c.heads_q * c.nq[i]; ++row) {
      if (skip(i, row % c.nq[i])) continue;  // row = head * nq + query
      const bool empty = std::isinf(ref_lse[row]);
      const int64_t dv = ValueDim(c);
      for (int64_t x = 0; x < dv; ++x) {
        const double got = LoadAsFloat(r.o.data(), (q_row0 + row) * dv + x, dtype);
        o_err.Add(got, ref_o[row * dv + x]);
        if (empty && got != 0.0) ++o_err.bad_empty;
      }
      if (c.return_lse) {
        const double got = r.lse[q_row0 + row];
        if (empty) {
          if (!(std::isinf(got) && got < 0)) ++lse_err.bad_empty;
        } else {
          lse_err.Add(got, ref_lse[row]);
        }
      }
    }
    q_row0 += c.heads_q * c.nq[i];
  }
  o_err.Expect("o", Tolerance(dtype));
  if (c.return_lse) lse_err.Expect("lse", Tolerance(dtype));
}

// Builds a pool and the sequences of `c` (pages shuffled over the pool), writes their K/V.
struct PoolSetup {
  std::unique_ptr<KvPagePool> pool;
  std::vector<Sequence> seqs;
  int64_t stride = 0;
};
void MakeSetup(const DecodeCase& c, DType dtype, std::mt19937_64& rng, PoolSetup* setup) {
  const KvShape shape = ShapeOf(c, dtype);
  const int64_t page_bytes = c.page_rows * c.heads_kv * shape.stored_dims() * DTypeSize(dtype);
  ASSERT_EQ(PageRows(page_bytes, shape), c.page_rows);
  int64_t needed = 0;
  for (int32_t nk : c.nk) {
    const int64_t pages = (nk + c.page_rows - 1) / c.page_rows;
    needed += pages;
    setup->stride = std::max(setup->stride, pages + 1);
  }
  const int64_t num_pages = needed + 3;
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool = MakeTestPool(num_pages, page_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  setup->pool = std::move(*pool);
  EXPECT_EQ(setup->pool->num_pages(), num_pages);
  EXPECT_EQ(setup->pool->page_bytes(), page_bytes);
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  auto next_page = order.begin();
  for (size_t i = 0; i < c.nk.size(); ++i) {
    Sequence s;
    s.q = RandomRounded(c.heads_q * c.nq[i] * c.head_dim, dtype, rng);
    s.k = RandomRounded(c.heads_kv * c.nk[i] * c.head_dim, dtype, rng);
    s.v = RandomRounded(c.heads_kv * c.nk[i] * ValueDim(c), dtype, rng);
    if (c.v_from_k) {  // v: k's first Dv features of each row
      const int64_t d = c.head_dim, dv = ValueDim(c);
      for (int64_t row = 0; row < c.heads_kv * c.nk[i]; ++row) {
        std::copy_n(s.k.begin() + row * d, dv, s.v.begin() + row * dv);
      }
    }
    s.pages.assign(setup->stride, -1);
    for (int64_t j = 0; j < (c.nk[i] + c.page_rows - 1) / c.page_rows; ++j)
      s.pages[j] = *next_page++;
    setup->seqs.push_back(std::move(s));
  }
  WriteSequences(*setup->pool, shape, setup->seqs, c.nk, c.write_layout, c.write_chunk, rng);
}

using Param = std::tuple<DecodeCase, DType>;

// Every suite skips where the backend has no pool (no GPU visible).
template <typename Base>
class PoolTest : public Base {
 protected:
  void SetUp() override {
    if (std::string reason = PoolUnavailableReason(); !reason.empty()) GTEST_SKIP() << reason;
  }
};

class PagedKvPoolTest : public PoolTest<testing::TestWithParam<Param>> {};

// The suites run per dtype, named by it.
const auto kAllDtypes = testing::Values(DType::kFloat16, DType::kBFloat16, DType::kFloat32);
std::string DtypeTestName(const testing::TestParamInfo<DType>& info) {
  return std::string(DTypeName(info.param));
}

TEST_P(PagedKvPoolTest, DecodeMatchesReference) {
  const auto& [c, dtype] = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(absl::StrCat(c.name, " ", SeedHint(dtype, seed)));
  std::mt19937_64 rng(seed);
  const float scale = c.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  PoolSetup setup;
  MakeSetup(c, dtype, rng, &setup);
  if (HasFatalFailure()) return;
  const StepResult r = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);
  ExpectMatchesReference(c, dtype, scale, setup.seqs, r);
}

std::vector<Param> Params() {
  std::vector<Param> params;
  for (const DecodeCase& c : Cases()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      params.emplace_back(c, dtype);
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Grid, PagedKvPoolTest, testing::ValuesIn(Params()),
                         [](const testing::TestParamInfo<Param>& info) {
                           return absl::StrCat(std::get<0>(info.param).name, "_",
                                               DTypeName(std::get<1>(info.param)));
                         });

// Rows a step must not read leave no trace in its results: every page first holds the NaN rows of
// a dropped sequence, so the unused tail of each sequence's last page is stale NaN; and K and V
// are NaN at keys outside every query's window and at keys that only some queries see (the left
// window edge of the first query, the last key, which causal hides from all but the last query).
// Queries that see a NaN key are not compared; all others must match the reference. At D = 64 and
// at MLA's absorbed shape (QK 576, V 512: the CUDA pool's wide tile).
class PagedKvPoolPoisonTest : public PoolTest<testing::TestWithParam<DType>> {};

TEST_P(PagedKvPoolPoisonTest, StaleAndMaskedRowsDoNotLeak) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  DecodeCase plain;
  plain.heads_q = 8;
  plain.heads_kv = 2;
  plain.nq = {3, 1, 4, 3};
  plain.nk = {100, 70, 130, 64};
  plain.window_left = 40;
  plain.window_right = 0;
  DecodeCase mla = plain;
  mla.heads_q = 16;
  mla.heads_kv = 1;
  mla.head_dim = 576;
  mla.v_head_dim = 512;
  for (DecodeCase c : {plain, mla}) {
    const int64_t dv = ValueDim(c);
    const KvShape shape = ShapeOf(c, dtype);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    for (int64_t page_rows : {32, 64}) {
      SCOPED_TRACE(absl::StrCat("D=", c.head_dim, " Dv=", dv, " page_rows=", page_rows));
      c.page_rows = page_rows;
      const int64_t page_bytes = page_rows * c.heads_kv * (c.head_dim + dv) * DTypeSize(dtype);
      int64_t needed = 0, stride = 0;
      for (int32_t nk : c.nk) {
        needed += (nk + page_rows - 1) / page_rows;
        stride = std::max<int64_t>(stride, (nk + page_rows - 1) / page_rows + 1);
      }
      const int64_t num_pages = needed + 2;
      absl::StatusOr<std::unique_ptr<KvPagePool>> pool = MakeTestPool(num_pages, page_bytes);
      ASSERT_TRUE(pool.ok()) << pool.status();

      // The dropped sequence: every row of every page NaN.
      Sequence dropped;
      const int32_t dropped_rows = static_cast<int32_t>(num_pages * page_rows);
      dropped.k.assign(c.heads_kv * dropped_rows * c.head_dim, kNaN);
      dropped.v.assign(c.heads_kv * dropped_rows * dv, kNaN);
      dropped.pages.resize(num_pages);
      std::iota(dropped.pages.begin(), dropped.pages.end(), 0);
      WriteSequences(**pool, shape, {dropped}, {dropped_rows}, Layout::kBHSD, 0, rng);
      if (HasFatalFailure()) return;

      // The live sequences, on the dropped sequence's pages in shuffled order.
      std::vector<int32_t> order(num_pages);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      auto next_page = order.begin();
      std::vector<Sequence> seqs;
      std::vector<std::vector<int64_t>> poisoned(c.nk.size());
      for (size_t i = 0; i < c.nk.size(); ++i) {
        const int64_t nq = c.nq[i], nk = c.nk[i];
        Sequence s;
        s.q = RandomRounded(c.heads_q * nq * c.head_dim, dtype, rng);
        s.k = RandomRounded(c.heads_kv * nk * c.head_dim, dtype, rng);
        s.v = RandomRounded(c.heads_kv * nk * dv, dtype, rng);
        s.pages.assign(stride, -1);
        for (int64_t j = 0; j < (nk + page_rows - 1) / page_rows; ++j) s.pages[j] = *next_page++;
        // Query i sees keys [i + nk - nq - window_left, i + nk - nq]: `first` is the first query's
        // lowest key, seen by it alone; first - 1 and key 0 are seen by none.
        const int64_t first = nk - nq - c.window_left;
        poisoned[i] = {0, first - 1};
        if (nq > 2) poisoned[i].insert(poisoned[i].end(), {first, nk - 1});
        for (int64_t key : poisoned[i]) {
          for (int64_t h = 0; h < c.heads_kv; ++h) {
            for (int64_t x = 0; x < c.head_dim; ++x) s.k[(h * nk + key) * c.head_dim + x] = kNaN;
            for (int64_t x = 0; x < dv; ++x) s.v[(h * nk + key) * dv + x] = kNaN;
          }
        }
        seqs.push_back(std::move(s));
      }
      WriteSequences(**pool, shape, seqs, c.nk, Layout::kBSHD, 0, rng);
      if (HasFatalFailure()) return;

      const StepResult r = Decode(**pool, c, dtype, scale, seqs, stride);
      ExpectMatchesReference(c, dtype, scale, seqs, r, [&](size_t i, int64_t query) {
        const int64_t lo = query + c.nk[i] - c.nq[i] - c.window_left, hi = lo + c.window_left;
        return std::any_of(poisoned[i].begin(), poisoned[i].end(),
                           [&](int64_t key) { return key >= lo && key <= hi; });
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PagedKvPoolPoisonTest, kAllDtypes, DtypeTestName);

// One Write of sequences of two shapes (a Step appending to sessions of different head dims on one
// device: the CUDA pool scatters 40-byte and 128-byte float16 rows, or 80- and 256-byte float32
// rows, in one launch): each then decodes as if written alone.
class PagedKvPoolWriteTest : public PoolTest<testing::TestWithParam<DType>> {};

TEST_P(PagedKvPoolWriteTest, OneWriteOfTwoShapes) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  DecodeCase cases[2];
  cases[0].heads_q = 2;
  cases[0].heads_kv = 2;
  cases[0].head_dim = 20;
  cases[0].nq = {1};
  cases[0].nk = {77};
  cases[1].heads_q = 4;
  cases[1].heads_kv = 2;
  cases[1].head_dim = 64;
  cases[1].nq = {2};
  cases[1].nk = {150};
  const int64_t page_bytes = 16 * 2 * 2 * 64 * 4;  // 16 to 96 rows of either shape
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool = MakeTestPool(32, page_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<int32_t> order(32);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Sequence seqs[2];
  std::vector<unsigned char> kb[2], vb[2];
  std::vector<KvWrite> writes;
  auto next_page = order.begin();
  for (int i = 0; i < 2; ++i) {
    const DecodeCase& c = cases[i];
    const int64_t nk = c.nk[0];
    const int64_t page_rows = PageRows(page_bytes, ShapeOf(c, dtype));
    ASSERT_GT(page_rows, 0);
    seqs[i].q = RandomRounded(c.heads_q * c.nq[0] * c.head_dim, dtype, rng);
    seqs[i].k = RandomRounded(c.heads_kv * nk * c.head_dim, dtype, rng);
    seqs[i].v = RandomRounded(c.heads_kv * nk * c.head_dim, dtype, rng);
    for (int64_t j = 0; j < (nk + page_rows - 1) / page_rows; ++j)
      seqs[i].pages.push_back(*next_page++);
    kb[i] = Encode(seqs[i].k, dtype);
    vb[i] = Encode(seqs[i].v, dtype);
    KvWrite& w = writes.emplace_back();
    w.shape = {dtype, c.heads_kv, c.head_dim};
    w.page_table = seqs[i].pages.data();
    w.rows = nk;
    w.k = kb[i].data();
    w.v = vb[i].data();
    w.head_stride = nk * c.head_dim;  // BHSD [Hkv, nk, D]
    w.row_stride = c.head_dim;
  }
  ASSERT_EQ((*pool)->Write(writes), absl::OkStatus());
  for (int i = 0; i < 2; ++i) {
    const DecodeCase& c = cases[i];
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const std::vector<Sequence> one = {seqs[i]};
    const StepResult r =
        Decode(**pool, c, dtype, scale, one, static_cast<int64_t>(seqs[i].pages.size()));
    ExpectMatchesReference(c, dtype, scale, one, r);
  }
}

// Several threads at once, each on sequences of its own in one pool, each rewriting all its rows
// before every step (as sessions append while others step; the CUDA pool's staging wraps around
// many times): every step matches its reference.
TEST_P(PagedKvPoolWriteTest, ConcurrentWritesAndStepsFromThreads) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  DecodeCase c;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.nq = {1, 2};
  c.nk = {700, 1500};
  c.page_rows = 64;
  constexpr int kThreads = 4, kSteps = 12;
  const int64_t page_bytes = c.page_rows * 2 * c.heads_kv * c.head_dim * DTypeSize(dtype);
  int64_t stride = 0;
  for (int32_t nk : c.nk) stride = std::max<int64_t>(stride, (nk + c.page_rows - 1) / c.page_rows);
  const int64_t num_pages = kThreads * static_cast<int64_t>(c.nk.size()) * stride;
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool = MakeTestPool(num_pages, page_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::mt19937_64 rng(seed);
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<Sequence>> seqs(kThreads);
  auto next_page = order.begin();
  for (int t = 0; t < kThreads; ++t) {
    for (size_t i = 0; i < c.nk.size(); ++i) {
      Sequence& s = seqs[t].emplace_back();
      s.q = RandomRounded(c.heads_q * c.nq[i] * c.head_dim, dtype, rng);
      s.k = RandomRounded(c.heads_kv * c.nk[i] * c.head_dim, dtype, rng);
      s.v = RandomRounded(c.heads_kv * c.nk[i] * c.head_dim, dtype, rng);
      s.pages.assign(stride, -1);
      for (int64_t j = 0; j < (c.nk[i] + c.page_rows - 1) / c.page_rows; ++j)
        s.pages[j] = *next_page++;
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const KvShape shape{dtype, c.heads_kv, c.head_dim};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 thread_rng(seed + t + 1);
      for (int step = 0; step < kSteps; ++step) {
        WriteSequences(**pool, shape, seqs[t], c.nk, Layout::kBHSD, 0, thread_rng);
        ExpectMatchesReference(c, dtype, scale, seqs[t],
                               Decode(**pool, c, dtype, scale, seqs[t], stride));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// `seqs` holding other rows (k negated, v reversed), the same pages, written into `pool`.
std::vector<Sequence> Rewrite(KvPagePool& pool, const DecodeCase& c, DType dtype,
                              const std::vector<Sequence>& seqs, std::mt19937_64& rng) {
  std::vector<Sequence> rewritten = seqs;
  for (Sequence& s : rewritten) {
    for (float& x : s.k) x = -x;
    std::reverse(s.v.begin(), s.v.end());
  }
  WriteSequences(pool, {dtype, c.heads_kv, c.head_dim}, rewritten, c.nk, Layout::kBHSD, 0, rng);
  return rewritten;
}

// A forked session's partial last page: CopyPages copies it to a free page, then the source page
// is overwritten (a write queued right after the copy, no wait between on a device pool): the copy
// decodes as the rows it was copied from, the source as its new rows.
TEST_P(PagedKvPoolWriteTest, CopiedPagesKeepTheRowsTheyWereCopiedFrom) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  DecodeCase c;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.nq = {1, 1};
  c.nk = {77, 45};  // pages of 32 rows: a partial third page, a partial second one
  PoolSetup setup;
  MakeSetup(c, dtype, rng, &setup);
  if (HasFatalFailure()) return;
  std::vector<int32_t> free_pages;
  for (int32_t page = 0; page < setup.pool->num_pages(); ++page) {
    bool used = false;
    for (const Sequence& s : setup.seqs) {
      used |= std::find(s.pages.begin(), s.pages.end(), page) != s.pages.end();
    }
    if (!used) free_pages.push_back(page);
  }
  ASSERT_GE(free_pages.size(), 2u);
  // The copies: each sequence's pages with its last one replaced by a copy.
  std::vector<Sequence> copies = setup.seqs;
  std::vector<std::pair<int32_t, int32_t>> src_dst;
  for (size_t i = 0; i < copies.size(); ++i) {
    int32_t& last = copies[i].pages[(c.nk[i] - 1) / c.page_rows];
    src_dst.emplace_back(last, free_pages[i]);
    last = free_pages[i];
  }
  ASSERT_EQ(setup.pool->CopyPages(src_dst), absl::OkStatus());
  // New rows for the sources' every row (their last pages included).
  const std::vector<Sequence> rewritten = Rewrite(*setup.pool, c, dtype, setup.seqs, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  // The copies' first pages are the sources' (rewritten): their reference is those rows, then
  // the last page's rows as first written.
  for (size_t i = 0; i < copies.size(); ++i) {
    const int64_t kept = (c.nk[i] - 1) / c.page_rows * c.page_rows;
    for (int64_t h = 0; h < c.heads_kv; ++h) {
      const int64_t at = h * c.nk[i] * c.head_dim;
      std::copy_n(rewritten[i].k.begin() + at, kept * c.head_dim, copies[i].k.begin() + at);
      std::copy_n(rewritten[i].v.begin() + at, kept * c.head_dim, copies[i].v.begin() + at);
    }
  }
  ExpectMatchesReference(c, dtype, scale, copies,
                         Decode(*setup.pool, c, dtype, scale, copies, setup.stride));
  ExpectMatchesReference(c, dtype, scale, rewritten,
                         Decode(*setup.pool, c, dtype, scale, rewritten, setup.stride));
}

// Read gives back the rows written, bit for bit: random row ranges (across page boundaries, a
// single row, every row) in BHSD [Hkv, rows, D] and BSHD [rows, Hkv, D] host buffers.
TEST_P(PagedKvPoolWriteTest, ReadGivesBackTheWrittenRows) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  // V of the QK head dim, of one of its own (MLA's QK 192 / V 128), and in K's rows (k alone read).
  for (const auto& [dv, from_k] :
       {std::pair{int64_t{0}, false}, {int64_t{128}, false}, {int64_t{128}, true}}) {
    SCOPED_TRACE(absl::StrCat("v_head_dim=", dv, from_k ? " v_from_k" : ""));
    DecodeCase c;
    c.heads_q = 4;
    c.heads_kv = 2;
    if (dv > 0) c.head_dim = 192;
    c.v_head_dim = dv;
    c.v_from_k = from_k;
    c.nq = {1, 1, 1};
    c.nk = {1, 33, 101};  // pages of 32 rows: one row, a page and one, a prime
    PoolSetup setup;
    MakeSetup(c, dtype, rng, &setup);
    if (HasFatalFailure()) return;
    const KvShape shape = ShapeOf(c, dtype);
    const int64_t hkv = c.heads_kv, d = c.head_dim, vd = ValueDim(c), elem = DTypeSize(dtype);
    for (size_t i = 0; i < c.nk.size(); ++i) {
      const Sequence& s = setup.seqs[i];
      const int64_t nk = c.nk[i];
      const std::vector<unsigned char> k = Encode(s.k, dtype), v = Encode(s.v, dtype);
      for (int trial = 0; trial < 8; ++trial) {
        const int64_t first =
            trial == 0 ? 0 : std::uniform_int_distribution<int64_t>(0, nk - 1)(rng);
        const int64_t rows =
            trial == 0 ? nk : std::uniform_int_distribution<int64_t>(1, nk - first)(rng);
        const bool bhsd = trial % 2 == 0;
        std::vector<unsigned char> k_out(hkv * rows * d * elem), v_out(hkv * rows * vd * elem);
        KvRead read;
        read.shape = shape;
        read.page_table = s.pages.data();
        read.first_row = first;
        read.rows = rows;
        read.k = k_out.data();
        read.v = from_k ? nullptr : v_out.data();
        read.head_stride = bhsd ? rows * d : d;
        read.row_stride = bhsd ? d : hkv * d;
        ASSERT_EQ(setup.pool->Read(read), absl::OkStatus());
        // v is laid out as k, with rows of Dv (VStride).
        const int64_t v_head_stride = VStride(shape, read.head_stride);
        const int64_t v_row_stride = VStride(shape, read.row_stride);
        for (int64_t h = 0; h < hkv; ++h) {
          for (int64_t r = 0; r < rows; ++r) {
            ASSERT_EQ(
                std::memcmp(k_out.data() + (h * read.head_stride + r * read.row_stride) * elem,
                            k.data() + ((h * nk) + first + r) * d * elem, d * elem),
                0)
                << "k of sequence " << i << " row " << first + r << " head " << h;
            if (from_k) continue;
            ASSERT_EQ(std::memcmp(v_out.data() + (h * v_head_stride + r * v_row_stride) * elem,
                                  v.data() + ((h * nk) + first + r) * vd * elem, vd * elem),
                      0)
                << "v of sequence " << i << " row " << first + r << " head " << h;
          }
        }
      }
    }
    // A row in a page the table does not hold (-1 past sequence 0's one page) is refused, as a
    // Write's.
    std::vector<unsigned char> out(hkv * std::max(d, vd) * elem);
    KvRead past;
    past.shape = shape;
    past.page_table = setup.seqs[0].pages.data();
    past.first_row = c.page_rows;
    past.rows = 1;
    past.k = out.data();
    past.v = from_k ? nullptr : out.data();
    past.head_stride = d;
    past.row_stride = d;
    EXPECT_FALSE(setup.pool->Read(past).ok());
  }
}

// The host tier's copies (KvPagePool::SavePages, LoadPages): every page of the sequences saved to
// host memory (slots in a shuffled order, so some pages are consecutive in both places and some
// are not), the pages then overwritten with other rows, and the saved ones loaded into a
// permutation of them: the sequences' tables after the permutation decode as the rows first
// written. Pages outside the pool, listed twice or without host memory are refused.
TEST_P(PagedKvPoolWriteTest, PagesSavedToTheHostAndLoadedElsewhereDecodeAsBefore) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  DecodeCase c;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.nq = {1, 2, 1};
  c.nk = {130, 1, 64};  // pages of 32 rows: 5 pages, the last of one row; one row; 2 full pages
  PoolSetup setup;
  MakeSetup(c, dtype, rng, &setup);
  if (HasFatalFailure()) return;
  KvPagePool& pool = *setup.pool;
  std::vector<int32_t> pages;
  for (const Sequence& seq : setup.seqs) {
    for (int32_t page : seq.pages) {
      if (page >= 0) pages.push_back(page);
    }
  }
  const auto count = static_cast<int64_t>(pages.size());
  absl::StatusOr<HostBuffer> host = pool.AllocateHost(count * pool.page_bytes());
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<int64_t> slots(count);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.begin() + count / 2, rng);  // the rest stay in order
  std::vector<HostPage> saved;
  for (int64_t i = 0; i < count; ++i) {
    saved.push_back({pages[i], host->get() + slots[i] * pool.page_bytes()});
  }
  ASSERT_EQ(pool.SavePages(saved), absl::OkStatus());
  Rewrite(pool, c, dtype, setup.seqs, rng);
  // Page pages[i] is loaded into moved[pages[i]].
  std::vector<int32_t> permuted = pages;
  std::shuffle(permuted.begin(), permuted.end(), rng);
  std::map<int32_t, int32_t> moved;
  std::vector<HostPage> loaded;
  for (int64_t i = 0; i < count; ++i) {
    moved[pages[i]] = permuted[i];
    loaded.push_back({permuted[i], saved[i].host});
  }
  ASSERT_EQ(pool.LoadPages(loaded), absl::OkStatus());
  std::vector<Sequence> restored = setup.seqs;
  for (Sequence& seq : restored) {
    for (int32_t& page : seq.pages) {
      if (page >= 0) page = moved[page];
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  ExpectMatchesReference(c, dtype, scale, restored,
                         Decode(pool, c, dtype, scale, restored, setup.stride));
  // Refused before any copy.
  unsigned char* slot = host->get();
  for (const std::vector<HostPage>& bad :
       {std::vector<HostPage>{{static_cast<int32_t>(pool.num_pages()), slot}},
        std::vector<HostPage>{{-1, slot}},
        std::vector<HostPage>{{pages[0], slot}, {pages[0], slot + pool.page_bytes()}},
        std::vector<HostPage>{{pages[0], nullptr}}}) {
    EXPECT_EQ(pool.SavePages(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(pool.LoadPages(bad).code(), absl::StatusCode::kInvalidArgument);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PagedKvPoolWriteTest, kAllDtypes, DtypeTestName);

class PagedKvPoolMergeTest : public PoolTest<testing::TestWithParam<DType>> {};

// Attention over keys [0, n) equals the LSE-weighted merge of attention over [0, n/2) and
// [n/2, n): two sequences of one step, each holding half of the keys, the same queries.
TEST_P(PagedKvPoolMergeTest, HalvesMergedByLseEqualWhole) {
  const DType dtype = GetParam();
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(SeedHint(dtype, seed));
  std::mt19937_64 rng(seed);
  DecodeCase c;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.nq = {1, 1};
  c.nk = {301, 300};
  const float scale = 1.0f / std::sqrt(128.0f);
  PoolSetup setup;
  MakeSetup(c, dtype, rng, &setup);
  if (HasFatalFailure()) return;
  setup.seqs[1].q = setup.seqs[0].q;
  const StepResult r = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);

  // The whole sequence: its K/V are the two halves' concatenated per head.
  Sequence whole;
  whole.q = setup.seqs[0].q;
  for (int64_t h = 0; h < c.heads_kv; ++h) {
    for (int half = 0; half < 2; ++half) {
      const Sequence& s = setup.seqs[half];
      const int64_t n = c.nk[half] * c.head_dim;
      whole.k.insert(whole.k.end(), s.k.begin() + h * n, s.k.begin() + (h + 1) * n);
      whole.v.insert(whole.v.end(), s.v.begin() + h * n, s.v.begin() + (h + 1) * n);
    }
  }
  std::vector<double> ref_o, ref_lse;
  Reference(c, scale, whole, 1, c.nk[0] + c.nk[1], &ref_o, &ref_lse);
  ErrorSums o_err, lse_err;
  for (int64_t h = 0; h < c.heads_q; ++h) {
    const double l0 = r.lse[h], l1 = r.lse[c.heads_q + h];
    const double m = std::max(l0, l1);
    const double w0 = std::exp(l0 - m), w1 = std::exp(l1 - m);
    lse_err.Add(m + std::log(w0 + w1), ref_lse[h]);
    for (int64_t x = 0; x < c.head_dim; ++x) {
      const double o0 = LoadAsFloat(r.o.data(), h * c.head_dim + x, dtype);
      const double o1 = LoadAsFloat(r.o.data(), (c.heads_q + h) * c.head_dim + x, dtype);
      o_err.Add((w0 * o0 + w1 * o1) / (w0 + w1), ref_o[h * c.head_dim + x]);
    }
  }
  o_err.Expect("merged o", Tolerance(dtype));
  lse_err.Expect("merged lse", Tolerance(dtype));
}

// Steps after the first on one pool give the first step's bytes: nothing a step leaves on the
// device (the CUDA kernels' split tickets, scratch) changes the next. A long sequence (many
// splits) beside a short one, then the long one alone (fewer row blocks).
TEST_P(PagedKvPoolMergeTest, RepeatedStepsRepeatTheFirst) {
  const DType dtype = GetParam();
  const std::vector<DecodeCase> cases = Cases();
  const DecodeCase& c = *std::find_if(cases.begin(), cases.end(), [](const DecodeCase& x) {
    return x.name.rfind("long_", 0) == 0;
  });
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(absl::StrCat(c.name, " ", SeedHint(dtype, seed)));
  std::mt19937_64 rng(seed);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  PoolSetup setup;
  MakeSetup(c, dtype, rng, &setup);
  if (HasFatalFailure()) return;
  DecodeCase one = c;
  one.nq.resize(1);
  one.nk.resize(1);
  const std::vector<Sequence> first(setup.seqs.begin(), setup.seqs.begin() + 1);
  const StepResult both = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);
  const StepResult alone = Decode(*setup.pool, one, dtype, scale, first, setup.stride);
  for (int rep = 0; rep < 2; ++rep) {
    const StepResult again = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);
    EXPECT_EQ(again.o, both.o) << "step " << rep + 2;
    EXPECT_EQ(std::memcmp(again.lse.data(), both.lse.data(), both.lse.size() * sizeof(float)), 0);
  }
  const StepResult alone_again = Decode(*setup.pool, one, dtype, scale, first, setup.stride);
  EXPECT_EQ(alone_again.o, alone.o);
}

// The same step with each sequence's q, o and lse in buffers of its own (as a Step's sessions
// keep them) answers bit for bit what the packed step does, sequences of several query counts.
TEST_P(PagedKvPoolMergeTest, PerSequenceBuffersAnswerAsPacked) {
  const DType dtype = GetParam();
  for (const DecodeCase& c : Cases()) {
    if (c.nq.size() < 2) continue;
    const uint64_t seed = NextSeed();
    SCOPED_TRACE(absl::StrCat(c.name, " ", SeedHint(dtype, seed)));
    std::mt19937_64 rng(seed);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    PoolSetup setup;
    MakeSetup(c, dtype, rng, &setup);
    if (HasFatalFailure()) return;
    const StepResult packed = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);
    const StepResult own =
        Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride, /*per_seq=*/true);
    EXPECT_EQ(own.o, packed.o);
    ASSERT_EQ(own.lse.size(), packed.lse.size());
    if (!packed.lse.empty()) {  // bit for bit (-inf rows too); empty when the case has no lse
      EXPECT_EQ(std::memcmp(own.lse.data(), packed.lse.data(), packed.lse.size() * sizeof(float)),
                0);
    }
    ExpectMatchesReference(c, dtype, scale, setup.seqs, own);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PagedKvPoolMergeTest, kAllDtypes, DtypeTestName);

// A step whose tensors are in the pool's device memory (rows written from there; q read and o and
// lse written there, packed in place behind the caller's events, and per sequence through the
// pool's copies) answers bit for bit what the same step from host memory answers. A backend
// without device memory refuses such steps UNIMPLEMENTED; there the second pool is written from
// host memory (in chunks of other sizes) and answers as the first. Every case, V head dims of their
// own too (the second pool's writes take the case's shape: v of Dv).
class PagedKvPoolDeviceMemoryTest : public PoolTest<testing::TestWithParam<DType>> {};

TEST_P(PagedKvPoolDeviceMemoryTest, AnswersAsFromHostMemory) {
  const DType dtype = GetParam();
  const PoolDeviceMemory device = TestPoolDeviceMemory();
  const PoolDeviceMemory* from_device = device.upload ? &device : nullptr;
  for (const DecodeCase& c : Cases()) {
    const uint64_t seed = NextSeed();
    SCOPED_TRACE(absl::StrCat(c.name, " ", SeedHint(dtype, seed)));
    std::mt19937_64 rng(seed);
    const float scale = c.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
    PoolSetup setup;
    MakeSetup(c, dtype, rng, &setup);
    if (HasFatalFailure()) return;
    const StepResult host = Decode(*setup.pool, c, dtype, scale, setup.seqs, setup.stride);
    auto expect_as_host = [&](const StepResult& r) {
      ASSERT_TRUE(r.status.ok()) << r.status;
      EXPECT_EQ(r.o, host.o);
      ASSERT_EQ(r.lse.size(), host.lse.size());
      if (!host.lse.empty()) {
        EXPECT_EQ(std::memcmp(r.lse.data(), host.lse.data(), host.lse.size() * sizeof(float)), 0);
      }
    };
    // The same pages of a second pool, written from device memory where the backend has it.
    absl::StatusOr<std::unique_ptr<KvPagePool>> again =
        MakeTestPool(setup.pool->num_pages(), setup.pool->page_bytes());
    ASSERT_TRUE(again.ok()) << again.status();
    WriteSequences(**again, ShapeOf(c, dtype), setup.seqs, c.nk, c.write_layout, c.write_chunk, rng,
                   from_device);
    if (HasFatalFailure()) return;
    if (from_device == nullptr) {
      StepMemory on_device{.on_device = true};
      KvWrite w{.shape = ShapeOf(c, dtype), .memory = on_device};
      EXPECT_EQ((*again)->Write({w}).code(), absl::StatusCode::kUnimplemented);
      PagedDecodeParams p{.shape = w.shape, .memory = on_device};
      EXPECT_EQ((*again)->Decode(p).status().code(), absl::StatusCode::kUnimplemented);
      expect_as_host(Decode(**again, c, dtype, scale, setup.seqs, setup.stride));
      continue;
    }
    for (bool per_seq : {false, true}) {
      SCOPED_TRACE(per_seq ? "per sequence" : "packed, in stream order");
      expect_as_host(
          Decode(**again, c, dtype, scale, setup.seqs, setup.stride, per_seq, from_device));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PagedKvPoolDeviceMemoryTest, kAllDtypes, DtypeTestName);

class PagedKvPoolErrorsTest : public PoolTest<testing::Test> {};

TEST_F(PagedKvPoolErrorsTest, RejectsPagesOutsideThePoolAndTooSmallPages) {
  const KvShape shape{DType::kFloat16, 2, 64};
  const int64_t page_bytes = 16 * 2 * 2 * 64 * 2;  // 16 rows of the shape
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool = MakeTestPool(4, page_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<uint16_t> rows(2 * 64, 0);
  const int32_t bad_table[] = {4};
  KvWrite w;
  w.shape = shape;
  w.page_table = bad_table;
  w.rows = 1;
  w.k = w.v = rows.data();
  w.head_stride = 64;
  w.row_stride = 128;
  EXPECT_EQ((*pool)->Write({w}).code(), absl::StatusCode::kInvalidArgument);
  // A batch is checked whole: a good write beside the bad one is refused with it.
  KvWrite good = w;
  const int32_t good_table[] = {0};
  good.page_table = good_table;
  EXPECT_EQ((*pool)->Write({good}), absl::OkStatus());
  EXPECT_EQ((*pool)->Write({good, w}).code(), absl::StatusCode::kInvalidArgument);
  // Strides of part rows: v's (VStride) would not be whole rows of Dv.
  KvWrite part_rows = good;
  part_rows.row_stride = 100;
  const absl::Status strides = (*pool)->Write({part_rows});
  EXPECT_EQ(strides.code(), absl::StatusCode::kInvalidArgument) << strides;
  EXPECT_THAT(strides.message(), testing::HasSubstr("strides must be multiples of head_dim (64)"));

  std::vector<uint16_t> q(2 * 64), o(2 * 64);
  const int32_t cu_q[] = {0, 1}, seqlens_k[] = {17};
  const int32_t table[] = {0, 7};  // the second page is outside the pool
  PagedDecodeParams p;
  p.shape = shape;
  p.heads_q = 2;
  p.num_seqs = 1;
  p.q = q.data();
  p.o = o.data();
  p.cu_seqlens_q = cu_q;
  p.total_q = 1;
  p.max_seqlen_q = 1;
  p.seqlens_k = seqlens_k;
  p.max_seqlen_k = 17;
  p.page_table = table;
  p.page_table_stride = 2;
  EXPECT_EQ((*pool)->Decode(p).status().code(), absl::StatusCode::kInvalidArgument);

  // q and o both packed and per sequence, or a sequence with queries but no buffer of its own.
  const int32_t in_pool[] = {0, 1};
  p.page_table = in_pool;
  ASSERT_EQ((*pool)->Decode(p).status(), absl::OkStatus());
  const void* q_seqs[] = {q.data()};
  void* o_seqs[] = {o.data()};
  p.q_seqs = q_seqs;
  p.o_seqs = o_seqs;
  EXPECT_EQ((*pool)->Decode(p).status().code(), absl::StatusCode::kInvalidArgument);
  p.q = nullptr;
  p.o = nullptr;
  ASSERT_EQ((*pool)->Decode(p).status(), absl::OkStatus());
  o_seqs[0] = nullptr;
  const absl::Status no_o = (*pool)->Decode(p).status();
  EXPECT_EQ(no_o.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_o.message(), testing::HasSubstr("sequence 0 has 1 queries but no q, o"));

  p.shape.head_dim = 128;  // 8 rows per page: too small for any sequence of this shape
  EXPECT_EQ((*pool)->Decode(p).status().code(), absl::StatusCode::kInvalidArgument);

  // Page copies: pages outside the pool, a destination twice, a destination also a source.
  using Copies = std::vector<std::pair<int32_t, int32_t>>;
  for (const auto& [copies, message] :
       {std::pair{Copies{{0, 4}}, "page 4 is outside the pool's 4 pages"},
        std::pair{Copies{{-1, 2}}, "page -1 is outside"},
        std::pair{Copies{{0, 2}, {1, 2}}, "page 2 is the destination of two copies"},
        std::pair{Copies{{0, 1}, {1, 2}}, "page 1 is both a source and a destination"}}) {
    const absl::Status refused = (*pool)->CopyPages(copies);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(refused.message(), testing::HasSubstr(message));
  }
  EXPECT_EQ((*pool)->CopyPages({}), absl::OkStatus());
  EXPECT_EQ((*pool)->CopyPages(Copies{{0, 1}, {0, 2}}), absl::OkStatus());  // one source twice
}

TEST(PageRowsTest, RoundsDownToSixteenRows) {
  EXPECT_EQ(PageRows(256 << 10, {DType::kBFloat16, 8, 128}), 64);
  EXPECT_EQ(PageRows(1 << 20, {DType::kBFloat16, 8, 128}), 256);
  EXPECT_EQ(PageRows(256 << 10, {DType::kFloat32, 8, 128}), 32);
  EXPECT_EQ(PageRows(256 << 10, {DType::kFloat16, 3, 100}), 208);  // 218.45 rows
  EXPECT_EQ(PageRows(4096, {DType::kFloat16, 8, 128}), 0);
  EXPECT_EQ(PageRows(0, {DType::kFloat16, 8, 128}), 0);
  // K and V of their own head dims: a row of 8 heads of 192 + 128 bf16 is 5,120 bytes.
  EXPECT_EQ(PageRows(256 << 10, {DType::kBFloat16, 8, 192, 128}), 48);   // 51.2 rows
  EXPECT_EQ(PageRows(256 << 10, {DType::kBFloat16, 8, 192, 192}), 32);   // 34.1 rows
  EXPECT_EQ(PageRows(256 << 10, {DType::kBFloat16, 1, 576, 512}), 112);  // 120.5 rows
}

}  // namespace
}  // namespace attention::kernel_test
