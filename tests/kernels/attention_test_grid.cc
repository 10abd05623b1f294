#include "tests/kernels/attention_test_grid.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dtype_convert.h"
#include "kernels/reference/reference_attention.h"

namespace attention::kernel_test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

AttentionCase Square(std::string name, int64_t n, int64_t d) {
  AttentionCase c;
  c.name = std::move(name);
  c.heads_q = c.heads_kv = 2;
  c.seqlen_q = c.seqlen_k = n;
  c.head_dim = d;
  return c;
}

uint64_t NextSeed() {
  if (const char* env = std::getenv("ATTENTION_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// A dtype array with its first element one element past an aligned address, so a backend that
// assumes more than element alignment (as protobuf strings give) fails here.
class HostArray {
 public:
  HostArray(DType dtype, int64_t elements)
      : dtype_(dtype), bytes_((elements + 1) * DTypeSize(dtype)) {}
  void* data() { return bytes_.data() + DTypeSize(dtype_); }
  float Get(int64_t i) const { return LoadAsFloat(bytes_.data() + DTypeSize(dtype_), i, dtype_); }
  void Set(int64_t i, float x) { StoreFromFloat(data(), i, dtype_, x); }

 private:
  DType dtype_;
  std::vector<unsigned char> bytes_;
};

std::string Describe(const AttentionCase& c, DType dtype, uint64_t seed) {
  std::string s =
      absl::StrCat(c.name, " dtype=", DTypeName(dtype), " B=", c.batch, " Hq=", c.heads_q,
                   " Hkv=", c.heads_kv, " Nq=", c.seqlen_q, " Nk=", c.seqlen_k, " D=", c.head_dim,
                   c.layout == Layout::kBHSD ? " BHSD" : " BSHD", " window=(", c.window_left, ",",
                   c.window_right, ")");
  if (c.mask_alignment == MaskAlignment::kTopLeft) absl::StrAppend(&s, " top_left");
  if (c.is_varlen()) absl::StrAppend(&s, " varlen");
  if (c.softmax_scale) absl::StrAppend(&s, " scale=", *c.softmax_scale);
  if (c.input_scale != 1.0f) absl::StrAppend(&s, " input_scale=", c.input_scale);
  if (c.sinks) absl::StrAppend(&s, " sinks");
  if (c.softcap > 0) absl::StrAppend(&s, " softcap=", c.softcap);
  if (c.chunk_size > 0) absl::StrAppend(&s, " chunk=", c.chunk_size);
  if (c.v_head_dim > 0) absl::StrAppend(&s, " Dv=", c.v_head_dim);
  absl::StrAppend(&s, " seed=", seed, " (rerun with ATTENTION_TEST_SEED=", seed, ")");
  return s;
}

}  // namespace

std::vector<AttentionCase> StandardGrid() {
  std::vector<AttentionCase> grid;
  auto add = [&grid](AttentionCase c) { grid.push_back(std::move(c)); };

  // Around every tile size a backend may use (32, 64, 128), with and without the causal mask.
  for (int64_t n : {1, 31, 32, 33, 63, 64, 65, 127, 128, 129}) {
    add(Square(absl::StrCat("n", n), n, 64));
    AttentionCase causal = Square(absl::StrCat("n", n, "_causal"), n, 64);
    causal.window_right = 0;
    causal.return_lse = true;
    add(causal);
  }
  // Primes, across head dims.
  {
    AttentionCase c = Square("prime17_d7", 17, 7);
    add(c);
    c = Square("prime61_d16_causal_b3", 61, 16);
    c.batch = 3;
    c.window_right = 0;
    add(c);
    c = Square("prime127_d80_lse", 127, 80);
    c.return_lse = true;
    add(c);
    c = Square("prime257_d96_causal", 257, 96);
    c.window_right = 0;
    add(c);
    c = Square("prime257_d128_bshd", 257, 128);
    c.layout = Layout::kBSHD;
    c.return_lse = true;
    add(c);
    c = Square("n65_d256_causal", 65, 256);
    c.window_right = 0;
    c.return_lse = true;
    add(c);
    c = Square("n130_d1", 130, 1);
    c.return_lse = true;
    add(c);
  }
  // Nq != Nk both ways; causal with Nq > Nk leaves the first Nq - Nk rows without a key.
  for (bool causal : {false, true}) {
    const char* suffix = causal ? "_causal" : "";
    AttentionCase c = Square(absl::StrCat("nq17_nk257", suffix), 0, 64);
    c.seqlen_q = 17;
    c.seqlen_k = 257;
    c.window_right = causal ? 0 : kUnboundedWindow;
    c.return_lse = true;
    add(c);
    c.name = absl::StrCat("nq257_nk17", suffix);
    c.seqlen_q = 257;
    c.seqlen_k = 17;
    c.layout = Layout::kBSHD;
    add(c);
  }
  // GQA ratios 2 and 8, MQA.
  {
    AttentionCase c = Square("gqa2", 100, 64);
    c.heads_q = 8;
    c.heads_kv = 4;
    add(c);
    c = Square("gqa8_causal_bshd", 129, 64);
    c.heads_q = 16;
    c.heads_kv = 2;
    c.window_right = 0;
    c.layout = Layout::kBSHD;
    c.return_lse = true;
    add(c);
    c = Square("mqa_b2", 70, 32);
    c.batch = 2;
    c.heads_q = 8;
    c.heads_kv = 1;
    c.return_lse = true;
    add(c);
  }
  // Sliding windows: left only, right only, both, with Nq != Nk, and windows that leave rows
  // without any key.
  {
    AttentionCase c = Square("window_left16", 150, 64);
    c.window_left = 16;
    add(c);
    c = Square("window_right5", 150, 64);
    c.window_right = 5;
    c.return_lse = true;
    add(c);
    c = Square("window_both_8_3_bshd", 200, 64);
    c.window_left = 8;
    c.window_right = 3;
    c.layout = Layout::kBSHD;
    add(c);
    c = Square("window_causal20_nq100_nk300", 0, 64);
    c.seqlen_q = 100;
    c.seqlen_k = 300;
    c.window_left = 20;
    c.window_right = 0;
    c.return_lse = true;
    add(c);
    c = Square("window_10_10_nq300_nk100", 0, 64);
    c.seqlen_q = 300;
    c.seqlen_k = 100;
    c.window_left = 10;
    c.window_right = 10;
    c.return_lse = true;
    add(c);
    c = Square("window_0_0_nq150_nk40_empty_rows", 0, 32);
    c.seqlen_q = 150;
    c.seqlen_k = 40;
    c.window_left = 0;
    c.window_right = 0;
    c.return_lse = true;
    add(c);
  }
  // Top-left aligned masks (torch SDPA's convention): query i's diagonal is key i, so with Nq < Nk
  // the last keys are seen only by windows reaching right, and with Nq > Nk the rows past Nk see
  // every key (causal) or none (a window that ends before them).
  {
    AttentionCase c = Square("top_left_causal_nq100_nk300_lse", 0, 64);
    c.seqlen_q = 100;
    c.seqlen_k = 300;
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    c.return_lse = true;
    add(c);
    c = Square("top_left_causal_nq300_nk100_gqa", 0, 64);
    c.heads_q = 4;
    c.seqlen_q = 300;
    c.seqlen_k = 100;
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    add(c);
    c = Square("top_left_causal_nq129_nk257_b2_bshd_d128", 0, 128);
    c.batch = 2;
    c.seqlen_q = 129;
    c.seqlen_k = 257;
    c.layout = Layout::kBSHD;
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    add(c);
    c = Square("top_left_window_20_0_nq70_nk200", 0, 32);
    c.seqlen_q = 70;
    c.seqlen_k = 200;
    c.window_left = 20;
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    add(c);
    c = Square("top_left_window_right5_nq70_nk200", 0, 64);
    c.seqlen_q = 70;
    c.seqlen_k = 200;
    c.window_right = 5;
    c.mask_alignment = MaskAlignment::kTopLeft;
    add(c);
    c = Square("top_left_window_10_10_nq300_nk100_empty_rows", 0, 64);
    c.seqlen_q = 300;
    c.seqlen_k = 100;
    c.window_left = 10;
    c.window_right = 10;
    c.mask_alignment = MaskAlignment::kTopLeft;
    c.return_lse = true;
    add(c);
    c = AttentionCase();
    c.name = "top_left_varlen_causal";
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = 64;
    c.varlen_q = {1, 37, 130, 64, 5};
    c.varlen_k = {1, 200, 130, 9, 70};
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    c.return_lse = true;
    add(c);
    c.name = "top_left_varlen_window_mqa_d80";
    c.heads_q = 3;
    c.heads_kv = 1;
    c.head_dim = 80;
    c.window_left = 7;
    c.window_right = 2;
    add(c);
  }
  // Custom softmax scales.
  {
    AttentionCase c = Square("scale0p3", 90, 64);
    c.softmax_scale = 0.3f;
    add(c);
    c = Square("scale2_causal_lse", 90, 48);
    c.softmax_scale = 2.0f;
    c.window_right = 0;
    c.return_lse = true;
    add(c);
  }
  // Varlen with ragged lengths, including length-1 items.
  {
    AttentionCase c;
    c.name = "varlen";
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = 64;
    c.varlen_q = {1, 37, 130, 64, 5};
    c.varlen_k = {1, 200, 130, 9, 1};
    c.return_lse = true;
    add(c);
    c.name = "varlen_causal";
    c.window_right = 0;
    add(c);
    c.name = "varlen_window_mqa_d80";
    c.heads_q = 3;
    c.heads_kv = 1;
    c.head_dim = 80;
    c.window_left = 7;
    c.window_right = 2;
    add(c);
  }
  // Non-finite K or V at keys that some rows see and others do not (causal and window edges,
  // Nq != Nk, tiles of 64 and 128 keys +-1): the rows that mask the key must not notice it.
  {
    using Target = AttentionCase::PoisonTarget;
    std::vector<AttentionCase> shapes;
    AttentionCase c = Square("poison_causal_n4", 4, 64);
    c.heads_q = c.heads_kv = 1;
    c.window_right = 0;
    c.return_lse = true;
    c.poison_keys = {3};
    shapes.push_back(c);
    c = Square("poison_causal_n129", 129, 64);
    c.window_right = 0;
    c.return_lse = true;
    c.poison_keys = {63, 64, 127, 128};
    shapes.push_back(c);
    c = Square("poison_window_8_3_n200_bshd", 200, 64);
    c.window_left = 8;
    c.window_right = 3;
    c.layout = Layout::kBSHD;
    c.poison_keys = {20, 64, 127, 199};
    shapes.push_back(c);
    c = Square("poison_window_30_0_nq65_nk129", 0, 128);
    c.seqlen_q = 65;
    c.seqlen_k = 129;
    c.window_left = 30;
    c.window_right = 0;
    c.return_lse = true;
    c.poison_keys = {63, 64, 65, 100, 128};
    shapes.push_back(c);
    c = Square("poison_window_5_5_nq129_nk63_gqa", 0, 64);
    c.heads_q = 4;
    c.heads_kv = 2;
    c.seqlen_q = 129;
    c.seqlen_k = 63;
    c.window_left = 5;
    c.window_right = 5;
    c.return_lse = true;
    c.poison_keys = {0, 31, 62};
    shapes.push_back(c);
    c = Square("poison_causal_nq257_nk65", 0, 64);
    c.seqlen_q = 257;
    c.seqlen_k = 65;
    c.window_right = 0;
    c.poison_keys = {1, 64};
    shapes.push_back(c);
    // Top-left: keys past row Nq - 1 are seen by no row.
    c = Square("poison_top_left_causal_nq65_nk129", 0, 64);
    c.seqlen_q = 65;
    c.seqlen_k = 129;
    c.window_right = 0;
    c.mask_alignment = MaskAlignment::kTopLeft;
    c.return_lse = true;
    c.poison_keys = {0, 31, 63, 64, 100};
    shapes.push_back(c);
    for (const AttentionCase& shape : shapes) {
      for (const auto& [target, target_name] : {std::pair{Target::kK, "k"}, {Target::kV, "v"}}) {
        for (const auto& [value, value_name] :
             {std::pair{std::numeric_limits<float>::quiet_NaN(), "nan"},
              {std::numeric_limits<float>::infinity(), "inf"}}) {
          c = shape;
          c.name = absl::StrCat(shape.name, "_", target_name, "_", value_name);
          c.poison_target = target;
          c.poison = value;
          add(c);
        }
      }
    }
  }
  // Large-magnitude inputs: logits near 1e3 must not overflow. The float32 error bound grows with
  // the logits (see float32_tolerance_factor).
  {
    AttentionCase c = Square("large_x30_causal", 129, 64);
    c.input_scale = 30.0f;
    c.window_right = 0;
    c.return_lse = true;
    c.float32_tolerance_factor = 30.0;
    add(c);
    c = Square("large_x30_bshd_gqa", 77, 16);
    c.heads_q = 4;
    c.heads_kv = 2;
    c.layout = Layout::kBSHD;
    c.input_scale = 30.0f;
    c.float32_tolerance_factor = 30.0;
    add(c);
  }
  return grid;
}

std::vector<AttentionCase> OpenModelGrid() {
  std::vector<AttentionCase> grid;
  // Each option alone and together, over shapes that cross tile edges (ragged, Nq != Nk, GQA).
  struct Shape {
    const char* name;
    int64_t nq, nk, hq, hkv, d, window_left, window_right;
  };
  const Shape shapes[] = {
      {"n97", 97, 97, 2, 2, 64, kUnboundedWindow, kUnboundedWindow},
      {"causal_gqa", 131, 131, 4, 2, 64, kUnboundedWindow, 0},
      {"decode", 3, 200, 8, 1, 32, kUnboundedWindow, 0},
      {"window", 150, 170, 2, 1, 48, 37, 0},
      {"noncausal_nq_gt_nk", 70, 45, 2, 2, 16, kUnboundedWindow, kUnboundedWindow}};
  struct Options {
    const char* name;
    bool sinks;
    float softcap;
    int64_t chunk_size, v_head_dim;
  };
  const Options options[] = {{"sinks", true, 0, 0, 0},   {"softcap", false, 2.5f, 0, 0},
                             {"chunk", false, 0, 32, 0}, {"chunk7", false, 0, 7, 0},
                             {"dv", false, 0, 0, 24},    {"all", true, 2.5f, 16, 40}};
  for (const Shape& shape : shapes) {
    for (const Options& option : options) {
      AttentionCase c;
      c.name = absl::StrCat(shape.name, "_", option.name);
      c.heads_q = shape.hq;
      c.heads_kv = shape.hkv;
      c.seqlen_q = shape.nq;
      c.seqlen_k = shape.nk;
      c.head_dim = shape.d;
      c.window_left = shape.window_left;
      c.window_right = shape.window_right;
      c.sinks = option.sinks;
      c.softcap = option.softcap;
      c.chunk_size = option.chunk_size;
      c.v_head_dim = option.v_head_dim;
      c.return_lse = true;
      grid.push_back(c);
    }
  }
  // MLA's shapes: prefill QK 192 / V 128 causal; absorbed decode, one KV head, QK 576, V 512.
  AttentionCase c = Square("mla_prefill", 67, 192);
  c.window_right = 0;
  c.v_head_dim = 128;
  c.return_lse = true;
  grid.push_back(c);
  c = Square("mla_decode", 2, 576);
  c.heads_q = 16;
  c.heads_kv = 1;
  c.seqlen_k = 90;
  c.window_right = 0;
  c.v_head_dim = 512;
  grid.push_back(c);
  // Varlen with a top-left chunked mask and sinks, poisoned keys outside some rows' chunks.
  c = AttentionCase{};
  c.name = "varlen_chunk_sinks_topleft_poison";
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 32;
  c.varlen_q = {40, 1, 77};
  c.varlen_k = {40, 30, 90};
  c.window_right = 0;
  c.mask_alignment = MaskAlignment::kTopLeft;
  c.chunk_size = 16;
  c.sinks = true;
  c.softcap = 5.0f;
  c.return_lse = true;
  c.poison_target = AttentionCase::PoisonTarget::kV;
  c.poison = std::numeric_limits<float>::quiet_NaN();
  c.poison_keys = {5, 20, 33};
  grid.push_back(c);
  return grid;
}

std::vector<AttentionCase> OpenModelGridSameVHeadDim() {
  std::vector<AttentionCase> grid;
  for (AttentionCase c : OpenModelGrid()) {
    if (c.v_head_dim != 0) {
      if (!c.sinks && c.softcap == 0.0f && c.chunk_size == 0) continue;
      c.v_head_dim = 0;
      c.name += "_same_dv";
    }
    grid.push_back(std::move(c));
  }
  return grid;
}

double DefaultTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 1e-5;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 1e-2;
    case DType::kFloat8E4M3:
      // The reference runs on the dequantised inputs, which every backend also computes on
      // exactly (e4m3 values are exact in float32 and bfloat16; the descales fold into float32
      // factors), so the error comes from the bfloat16 roundings after the inputs. bfloat16 keeps
      // 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself. o's
      // rounding is one such (at most 2^-8 of ||o||); on tensor cores P's before P V is the other:
      // it moves o_x by at most 2^-8 sum_j P_j |v_jx| / l, which for the zero-mean inputs here is
      // of the order of |o_x| (the rounding errors of independent P_j add in quadrature, as the
      // P_j v_jx do). Two roundings of 2^-8: 2^-7. Measured on the CPU backend (o's rounding
      // only): 1.1e-3 to 1.9e-3, as a uniform rounding error gives (rms ~1.6e-3). The Hopper
      // kernel's native path rounds P to float8 instead: Float8RoundedPTolerance.
      return 1.0 / 128;
  }
  return 0;
}

double Float8RoundedPTolerance() {
  // e4m3 keeps 4 significant bits: rounding P_j to nearest moves it by at most 2^-4 of itself,
  // and for P spread over a binade the error is close to uniform, whose rms is (max) / sqrt(3).
  // o_x = sum_j P_j v_jx / l (l sums the unrounded float32 P, so it carries no such error) moves
  // by sum_j d_j P_j v_jx / l; with independent d_j and the zero-mean v here, its rms is that of
  // d times the rms of o_x itself (both sums add in quadrature over the same P_j v_jx), so
  // ||error|| / ||o|| <= 2^-4 / sqrt(3) ~= 0.036, plus o's bfloat16 rounding (2^-8). A numpy
  // model of the kernel's arithmetic (P = 2^(s - max + 8) rounded to e4m3, float64 elsewhere)
  // gives 0.024-0.025 at N = 300-4096, D = 128 and 256, and less where a few keys dominate
  // (large-magnitude logits: 0.004-0.007), as FlashAttention-3's float8 path does.
  return 1.0 / 16 / std::sqrt(3.0) + 1.0 / 256;
}

HostBufferBytes BufferBytes(const AttentionParams& p) {
  const size_t elem = DTypeSize(p.dtype);
  const int64_t rows_q = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  const int64_t rows_k = p.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
  HostBufferBytes bytes;
  bytes.q = rows_q * p.heads_q * p.head_dim * elem;
  bytes.o = rows_q * p.heads_q * p.value_head_dim() * DTypeSize(OutputDType(p.dtype));
  bytes.k = rows_k * p.heads_kv * p.head_dim * elem;
  bytes.v = rows_k * p.heads_kv * p.value_head_dim() * elem;
  bytes.lse = p.lse == nullptr ? 0 : rows_q * p.heads_q * sizeof(float);
  return bytes;
}

std::string CaseName(const AttentionCase& c, DType dtype) {
  return absl::StrCat(c.name, "_", DTypeName(dtype));
}

void CheckCase(const AttentionCase& c, DType dtype, const HostForward& forward, double tolerance) {
  const uint64_t seed = NextSeed();
  SCOPED_TRACE(Describe(c, dtype, seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, c.input_scale);

  AttentionParams p;
  p.dtype = dtype;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.mask_alignment = c.mask_alignment;
  p.chunk_size = c.chunk_size;
  p.softcap = c.softcap;
  p.v_head_dim = c.v_head_dim;
  std::vector<float> sinks;
  if (c.sinks) {
    std::normal_distribution<float> sink(0.0f, 2.0f);
    for (int64_t h = 0; h < c.heads_q; ++h) sinks.push_back(sink(rng));
    p.sinks = sinks.data();
  }
  p.softmax_scale = c.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  if (dtype == DType::kFloat8E4M3) {
    // Fresh descales, log-uniform and almost never powers of two (so no backend gets them free):
    // q's and k's near 1 (they scale the logits, which the large-magnitude cases already push),
    // v's over a wider range (it only scales o).
    std::uniform_real_distribution<float> log2_qk(-1.0f, 1.0f), log2_v(-4.0f, 4.0f);
    p.q_descale = std::exp2(log2_qk(rng));
    p.k_descale = std::exp2(log2_qk(rng));
    p.v_descale = std::exp2(log2_v(rng));
  }
  SCOPED_TRACE(absl::StrCat("descales q ", p.q_descale, " k ", p.k_descale, " v ", p.v_descale));
  std::vector<int32_t> cu_q, cu_k;
  if (c.is_varlen()) {
    ASSERT_EQ(c.varlen_q.size(), c.varlen_k.size());
    cu_q.push_back(0);
    cu_k.push_back(0);
    for (size_t b = 0; b < c.varlen_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + c.varlen_q[b]);
      cu_k.push_back(cu_k.back() + c.varlen_k[b]);
    }
    p.batch = static_cast<int64_t>(c.varlen_q.size());
    p.seqlen_q = *std::max_element(c.varlen_q.begin(), c.varlen_q.end());
    p.seqlen_k = *std::max_element(c.varlen_k.begin(), c.varlen_k.end());
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
    p.total_q = cu_q.back();
    p.total_k = cu_k.back();
  } else {
    p.batch = c.batch;
    p.seqlen_q = c.seqlen_q;
    p.seqlen_k = c.seqlen_k;
  }
  p.SetContiguousStrides(c.layout);

  const int64_t rows_q = c.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
  const int64_t rows_k = c.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
  const int64_t dv = p.value_head_dim();
  const int64_t q_elements = rows_q * p.heads_q * p.head_dim;
  const int64_t o_elements = rows_q * p.heads_q * dv;
  const int64_t k_elements = rows_k * p.heads_kv * p.head_dim;
  const int64_t v_elements = rows_k * p.heads_kv * dv;
  const int64_t lse_elements = rows_q * p.heads_q;
  HostArray q(dtype, q_elements), k(dtype, k_elements), v(dtype, v_elements),
      o(OutputDType(dtype), o_elements);
  for (int64_t i = 0; i < q_elements; ++i) q.Set(i, normal(rng));
  for (int64_t i = 0; i < k_elements; ++i) k.Set(i, normal(rng));
  for (int64_t i = 0; i < v_elements; ++i) v.Set(i, normal(rng));
  // Item b's first row and lengths.
  auto item_rows = [&](int64_t b) {
    if (!c.is_varlen()) return std::array<int64_t, 3>{0, p.seqlen_q, p.seqlen_k};
    return std::array<int64_t, 3>{cu_k[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]};
  };
  if (c.poison_target != AttentionCase::PoisonTarget::kNone) {
    const bool on_k = c.poison_target == AttentionCase::PoisonTarget::kK;
    HostArray& t = on_k ? k : v;
    const int64_t batch_stride = on_k ? p.k_batch_stride : p.v_batch_stride;
    const int64_t head_stride = on_k ? p.k_head_stride : p.v_head_stride;
    const int64_t row_stride = on_k ? p.k_row_stride : p.v_row_stride;
    for (int64_t b = 0; b < p.batch; ++b) {
      const auto [k_row0, nq, nk] = item_rows(b);
      for (int64_t key : c.poison_keys) {
        if (key >= nk) continue;
        for (int64_t h = 0; h < p.heads_kv; ++h) {
          for (int64_t x = 0; x < (on_k ? p.head_dim : dv); ++x) {
            t.Set(b * batch_stride + h * head_stride + (k_row0 + key) * row_stride + x, c.poison);
          }
        }
      }
    }
  }
  // Whether item-local row i of item b sees a poisoned key.
  auto sees_poison = [&](int64_t b, int64_t i) {
    const auto [k_row0, nq, nk] = item_rows(b);
    const RowKeys visible = VisibleKeys(p, i, nq, nk);
    for (int64_t key : c.poison_keys) {
      if (key < nk && key >= visible.lo && key <= visible.hi) return true;
    }
    return false;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < o_elements; ++i) o.Set(i, nan);
  std::vector<float> lse(c.return_lse ? lse_elements : 0, nan);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o.data();
  p.lse = c.return_lse ? lse.data() : nullptr;

  std::vector<double> ref_o, ref_lse;
  ASSERT_TRUE(reference::Forward(p, &ref_o, &ref_lse).ok());
  ASSERT_EQ(static_cast<int64_t>(ref_o.size()), o_elements);
  ASSERT_EQ(static_cast<int64_t>(ref_lse.size()), lse_elements);

  const absl::Status status = forward(p);
  ASSERT_TRUE(status.ok()) << status;

  // float8 gets its bfloat16 roundings (DefaultTolerance) plus the float32 arithmetic's own error,
  // which the conditioning of large-magnitude cases raises (float32_tolerance_factor).
  const double bound =
      dtype == DType::kFloat32 ? tolerance * c.float32_tolerance_factor
      : dtype == DType::kFloat8E4M3
          ? tolerance + DefaultTolerance(DType::kFloat32) * c.float32_tolerance_factor
          : tolerance;
  // Rows compared, by their lse position [B, Hq, Nq] (varlen [Hq, total_q]), and the o element
  // offset of each compared element (o rows are found through the o strides).
  std::vector<char> compared(lse_elements, 0);
  std::vector<int64_t> o_compared;
  o_compared.reserve(o_elements);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t row0 = c.is_varlen() ? cu_q[b] : 0;
    const int64_t nq = c.is_varlen() ? cu_q[b + 1] - cu_q[b] : p.seqlen_q;
    for (int64_t h = 0; h < p.heads_q; ++h) {
      for (int64_t i = 0; i < nq; ++i) {
        if (sees_poison(b, i)) continue;
        compared[b * p.lse_batch_stride + h * p.lse_head_stride + row0 + i] = 1;
        const int64_t base =
            b * p.o_batch_stride + h * p.o_head_stride + (row0 + i) * p.o_row_stride;
        for (int64_t x = 0; x < dv; ++x) o_compared.push_back(base + x);
      }
    }
  }
  int64_t non_finite = 0;
  double err2 = 0, ref2 = 0;
  for (int64_t i : o_compared) {
    const double x = o.Get(i);
    if (!std::isfinite(x)) {
      ++non_finite;
      continue;
    }
    err2 += (x - ref_o[i]) * (x - ref_o[i]);
    ref2 += ref_o[i] * ref_o[i];
  }
  EXPECT_EQ(non_finite, 0) << "o elements left NaN (unwritten) or computed non-finite, of "
                           << o_compared.size() << " compared";
  EXPECT_LE(std::sqrt(err2), bound * std::sqrt(ref2))
      << "o relative error " << std::sqrt(err2 / ref2);

  // Rows that see no key (reference lse = -inf): o exactly 0, lse = -inf. Positions follow the
  // lse layout [B, Hq, Nq] (varlen [Hq, total_q]); o rows are found through the o strides.
  int64_t bad_empty_rows = 0, empty_rows = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t row0 = c.is_varlen() ? cu_q[b] : 0;
    const int64_t nq = c.is_varlen() ? cu_q[b + 1] - cu_q[b] : p.seqlen_q;
    for (int64_t h = 0; h < p.heads_q; ++h) {
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t l = b * p.lse_batch_stride + h * p.lse_head_stride + row0 + i;
        if (!compared[l] || ref_lse[l] != -kInf) continue;
        ++empty_rows;
        const int64_t base =
            b * p.o_batch_stride + h * p.o_head_stride + (row0 + i) * p.o_row_stride;
        bool bad = c.return_lse && lse[l] != -std::numeric_limits<float>::infinity();
        for (int64_t x = 0; x < dv; ++x) bad = bad || o.Get(base + x) != 0.0f;
        bad_empty_rows += bad;
      }
    }
  }
  EXPECT_EQ(bad_empty_rows, 0) << "of " << empty_rows
                               << " rows that see no key, these lack o = 0 / lse = -inf";

  if (c.return_lse) {
    int64_t lse_nan = 0, lse_bad_inf = 0;
    double lse_err2 = 0, lse_ref2 = 0;
    for (int64_t i = 0; i < lse_elements; ++i) {
      if (!compared[i]) continue;
      if (std::isnan(lse[i])) {
        ++lse_nan;
      } else if (ref_lse[i] == -kInf || std::isinf(lse[i])) {
        lse_bad_inf += ref_lse[i] != lse[i];
      } else {
        lse_err2 += (lse[i] - ref_lse[i]) * (lse[i] - ref_lse[i]);
        lse_ref2 += ref_lse[i] * ref_lse[i];
      }
    }
    EXPECT_EQ(lse_nan, 0) << "lse elements left NaN of " << lse_elements;
    EXPECT_EQ(lse_bad_inf, 0) << "lse elements infinite where the reference is finite or back";
    EXPECT_LE(std::sqrt(lse_err2), bound * std::sqrt(lse_ref2))
        << "lse relative error " << std::sqrt(lse_err2 / lse_ref2);
  }
}

}  // namespace attention::kernel_test
