// Writes the fuzzer's seed corpus: serialized AttendRequests, small enough for fast fuzzing, that
// cover each feature the decoder handles (dtypes, layouts, GQA/MQA, causal, windows, scale, LSE,
// varlen) plus a few malformed ones near the edges the validation guards. The data bytes come
// from a fixed seed so the corpus in fuzz/corpus/ is reproducible:
//
//   write_seed_corpus fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "attention/v1/attention.pb.h"

namespace {

using attention::v1::AttendRequest;
using attention::v1::DType;
using attention::v1::Tensor;

std::mt19937 rng(20240611);

void SetTensor(Tensor* t, DType dtype, const std::vector<int64_t>& shape) {
  t->set_dtype(dtype);
  int64_t bytes = dtype == attention::v1::DTYPE_FLOAT32 ? 4 : 2;
  for (int64_t d : shape) {
    t->add_shape(d);
    bytes *= d;
  }
  // Small values: the exponent byte of each element stays in a sane range for every dtype.
  std::string data(static_cast<size_t>(bytes), '\0');
  for (char& c : data) c = static_cast<char>(rng() % 64);
  t->set_data(std::move(data));
}

// q [B, Hq, Nq, D] (or BSHD order), k and v [B, Hkv, Nk, D].
AttendRequest Dense(DType dtype, int64_t b, int64_t hq, int64_t hkv, int64_t nq, int64_t nk,
                    int64_t d, bool bshd = false) {
  AttendRequest r;
  r.set_request_id("seed");
  if (bshd) r.set_layout(attention::v1::LAYOUT_BSHD);
  SetTensor(r.mutable_q(), dtype,
            bshd ? std::vector<int64_t>{b, nq, hq, d} : std::vector<int64_t>{b, hq, nq, d});
  for (Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    SetTensor(t, dtype,
              bshd ? std::vector<int64_t>{b, nk, hkv, d} : std::vector<int64_t>{b, hkv, nk, d});
  }
  return r;
}

// Packed q [sum(lq), Hq, D], k and v [sum(lk), Hkv, D] with their cu_seqlens.
AttendRequest Varlen(DType dtype, int64_t hq, int64_t hkv, int64_t d,
                     const std::vector<int32_t>& lq, const std::vector<int32_t>& lk) {
  AttendRequest r;
  int32_t tq = 0, tk = 0;
  r.add_cu_seqlens_q(0);
  r.add_cu_seqlens_k(0);
  for (int32_t n : lq) r.add_cu_seqlens_q(tq += n);
  for (int32_t n : lk) r.add_cu_seqlens_k(tk += n);
  SetTensor(r.mutable_q(), dtype, {tq, hq, d});
  SetTensor(r.mutable_k(), dtype, {tk, hkv, d});
  SetTensor(r.mutable_v(), dtype, {tk, hkv, d});
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  const DType f32 = attention::v1::DTYPE_FLOAT32;
  const DType f16 = attention::v1::DTYPE_FLOAT16;
  const DType bf16 = attention::v1::DTYPE_BFLOAT16;
  std::vector<std::pair<std::string, AttendRequest>> seeds;
  seeds.emplace_back("dense_f32", Dense(f32, 1, 2, 2, 3, 5, 8));
  seeds.emplace_back("dense_f16_gqa", Dense(f16, 2, 4, 2, 4, 3, 8));
  seeds.emplace_back("dense_bf16_mqa_bshd", Dense(bf16, 1, 4, 1, 2, 6, 16, /*bshd=*/true));
  {
    AttendRequest r = Dense(f32, 1, 2, 1, 6, 4, 8);
    r.set_causal(true);
    r.set_return_lse(true);
    seeds.emplace_back("causal_lse_nq_gt_nk", r);
  }
  {
    AttendRequest r = Dense(f16, 1, 1, 1, 5, 9, 4, /*bshd=*/true);
    r.set_window_left(2);
    r.set_window_right(1);
    r.set_softmax_scale(0.25f);
    seeds.emplace_back("window_scale", r);
  }
  {
    AttendRequest r = Varlen(f32, 2, 1, 8, {3, 1, 4}, {2, 5, 4});
    r.set_causal(true);
    r.set_return_lse(true);
    seeds.emplace_back("varlen_causal_lse", r);
  }
  seeds.emplace_back("varlen_bf16", Varlen(bf16, 2, 2, 16, {2, 2}, {3, 1}));
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 1, 1, 256);
    seeds.emplace_back("head_dim_256", r);
  }
  // Malformed, one step from valid: the fuzzer starts at the edges.
  {
    AttendRequest r = Dense(f32, 1, 2, 2, 3, 5, 8);
    r.mutable_k()->mutable_data()->pop_back();
    seeds.emplace_back("bad_byte_size", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 3, 2, 3, 5, 8);
    seeds.emplace_back("bad_heads", r);
  }
  {
    AttendRequest r = Varlen(f16, 1, 1, 8, {2, 2}, {3, 1});
    r.set_cu_seqlens_q(1, 5);
    seeds.emplace_back("bad_cu_seqlens", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 2, 2, 8);
    r.mutable_q()->set_shape(0, int64_t{1} << 62);
    seeds.emplace_back("bad_overflow", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 2, 2, 8);
    r.set_window_left(-1);
    seeds.emplace_back("bad_window", r);
  }

  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  for (const auto& [name, request] : seeds) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    if (!request.SerializeToOstream(&out)) {
      std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
  return 0;
}
