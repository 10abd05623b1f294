// Writes the fuzzer's seed corpus, small enough for fast fuzzing, in the fuzzer's input format (a
// first byte picking the message, see request_decoder_fuzzer.cc): AttendRequests that cover each
// feature the decoder handles (dtypes, layouts, GQA/MQA, causal, windows, scale, LSE, varlen);
// CreateSession, AppendKv and Step requests (with the 4 bytes of the session they run against)
// over dtypes, layouts, GQA, decode and extend steps, masks and LSE; plus a few malformed ones of
// each near the edges the validation guards. The data bytes come from a fixed seed so the corpus
// in fuzz/corpus/ is reproducible:
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
#include "google/protobuf/message.h"

namespace {

using attention::v1::AppendKvRequest;
using attention::v1::AttendRequest;
using attention::v1::CreateSessionRequest;
using attention::v1::DType;
using attention::v1::StepEntry;
using attention::v1::StepRequest;
using attention::v1::Tensor;

// The fuzzer's first byte: which message follows.
constexpr char kAttend = 0;
constexpr char kCreate = 1;
constexpr char kAppend = 2;
constexpr char kStep = 3;

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

// The selector byte and, for AppendKv and Step, the session the fuzzer runs them against (dtype,
// kv heads - 1, head dim - 1, rows held; see SessionFromBytes), before the serialized message.
std::string Input(char selector, const google::protobuf::Message& message) {
  return std::string(1, selector) + message.SerializeAsString();
}
std::string SessionInput(char selector, DType dtype, int hkv, int d, int length,
                         const google::protobuf::Message& message) {
  const char dtype_index = dtype == attention::v1::DTYPE_FLOAT32   ? 0
                           : dtype == attention::v1::DTYPE_FLOAT16 ? 1
                                                                   : 2;
  return std::string{selector, dtype_index, static_cast<char>(hkv - 1), static_cast<char>(d - 1),
                     static_cast<char>(length)} +
         message.SerializeAsString();
}

// k and v rows [Hkv, n, D] (or [n, Hkv, D] when bshd).
void SetRows(Tensor* k, Tensor* v, DType dtype, int64_t hkv, int64_t n, int64_t d,
             bool bshd = false) {
  for (Tensor* t : {k, v}) {
    SetTensor(t, dtype, bshd ? std::vector<int64_t>{n, hkv, d} : std::vector<int64_t>{hkv, n, d});
  }
}

CreateSessionRequest Create(DType dtype, int32_t hkv, int32_t d, int64_t rows, bool bshd = false) {
  CreateSessionRequest r;
  r.set_dtype(dtype);
  r.set_kv_heads(hkv);
  r.set_head_dim(d);
  if (bshd) r.set_layout(attention::v1::LAYOUT_BSHD);
  if (rows > 0) SetRows(r.mutable_k(), r.mutable_v(), dtype, hkv, rows, d, bshd);
  return r;
}

AppendKvRequest Append(DType dtype, int64_t hkv, int64_t d, int64_t rows, bool bshd = false) {
  AppendKvRequest r;
  r.set_session_id("0123456789abcdef0123456789abcdef");
  if (bshd) r.set_layout(attention::v1::LAYOUT_BSHD);
  SetRows(r.mutable_k(), r.mutable_v(), dtype, hkv, rows, d, bshd);
  return r;
}

// One entry: q [Hq, Nq, D] and, when rows > 0, k and v [Hkv, rows, D].
void AddEntry(StepRequest* r, const std::string& id, DType dtype, int64_t hq, int64_t nq,
              int64_t hkv, int64_t rows, int64_t d) {
  StepEntry* e = r->add_entries();
  e->set_session_id(id);
  SetTensor(e->mutable_q(), dtype, {hq, nq, d});
  if (rows > 0) SetRows(e->mutable_k(), e->mutable_v(), dtype, hkv, rows, d);
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
  std::vector<std::pair<std::string, AttendRequest>> attend;
  attend.emplace_back("dense_f32", Dense(f32, 1, 2, 2, 3, 5, 8));
  attend.emplace_back("dense_f16_gqa", Dense(f16, 2, 4, 2, 4, 3, 8));
  attend.emplace_back("dense_bf16_mqa_bshd", Dense(bf16, 1, 4, 1, 2, 6, 16, /*bshd=*/true));
  {
    AttendRequest r = Dense(f32, 1, 2, 1, 6, 4, 8);
    r.set_causal(true);
    r.set_return_lse(true);
    attend.emplace_back("causal_lse_nq_gt_nk", r);
  }
  {
    AttendRequest r = Dense(f16, 1, 1, 1, 5, 9, 4, /*bshd=*/true);
    r.set_window_left(2);
    r.set_window_right(1);
    r.set_softmax_scale(0.25f);
    attend.emplace_back("window_scale", r);
  }
  {
    AttendRequest r = Varlen(f32, 2, 1, 8, {3, 1, 4}, {2, 5, 4});
    r.set_causal(true);
    r.set_return_lse(true);
    attend.emplace_back("varlen_causal_lse", r);
    r.set_mask_alignment(attention::v1::MASK_ALIGN_TOP_LEFT);
    attend.emplace_back("varlen_causal_top_left", r);
  }
  attend.emplace_back("varlen_bf16", Varlen(bf16, 2, 2, 16, {2, 2}, {3, 1}));
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 1, 1, 256);
    attend.emplace_back("head_dim_256", r);
  }
  // Malformed, one step from valid: the fuzzer starts at the edges.
  {
    AttendRequest r = Dense(f32, 1, 2, 2, 3, 5, 8);
    r.mutable_k()->mutable_data()->pop_back();
    attend.emplace_back("bad_byte_size", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 3, 2, 3, 5, 8);
    attend.emplace_back("bad_heads", r);
  }
  {
    AttendRequest r = Varlen(f16, 1, 1, 8, {2, 2}, {3, 1});
    r.set_cu_seqlens_q(1, 5);
    attend.emplace_back("bad_cu_seqlens", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 2, 2, 8);
    r.mutable_q()->set_shape(0, int64_t{1} << 62);
    attend.emplace_back("bad_overflow", r);
  }
  {
    AttendRequest r = Dense(f32, 1, 1, 1, 2, 2, 8);
    r.set_window_left(-1);
    attend.emplace_back("bad_window", r);
  }

  std::vector<std::pair<std::string, std::string>> seeds;
  for (const auto& [name, request] : attend) seeds.emplace_back(name, Input(kAttend, request));

  // CreateSession.
  seeds.emplace_back("create_f16_rows", Input(kCreate, Create(f16, 2, 8, 3)));
  seeds.emplace_back("create_bf16_bshd_rows", Input(kCreate, Create(bf16, 1, 16, 5, true)));
  seeds.emplace_back("create_f32_empty", Input(kCreate, Create(f32, 4, 256, 0)));
  seeds.emplace_back("create_bad_head_dim", Input(kCreate, Create(f32, 1, 257, 0)));
  {
    CreateSessionRequest r = Create(f16, 2, 8, 3);
    r.clear_v();
    seeds.emplace_back("create_bad_k_without_v", Input(kCreate, r));
  }
  // AppendKv, against a session of the same shape holding some rows.
  seeds.emplace_back("append_f32", SessionInput(kAppend, f32, 2, 8, 5, Append(f32, 2, 8, 3)));
  seeds.emplace_back("append_bf16_bshd",
                     SessionInput(kAppend, bf16, 1, 16, 0, Append(bf16, 1, 16, 4, true)));
  seeds.emplace_back("append_bad_heads", SessionInput(kAppend, f16, 2, 8, 1, Append(f16, 3, 8, 2)));
  {
    AppendKvRequest r = Append(f32, 1, 8, 2);
    r.mutable_v()->set_shape(1, 3);
    seeds.emplace_back("append_bad_v_rows", SessionInput(kAppend, f32, 1, 8, 1, r));
  }
  // Step: decode (one query, the new token appended), extend (several queries), GQA, masks, LSE.
  {
    StepRequest r;
    r.set_request_id("seed");
    AddEntry(&r, "a", f16, 4, 1, 2, 1, 8);
    AddEntry(&r, "b", f16, 4, 1, 2, 1, 8);
    r.set_causal(true);
    seeds.emplace_back("step_decode_f16_gqa", SessionInput(kStep, f16, 2, 8, 6, r));
  }
  {
    StepRequest r;
    AddEntry(&r, "a", f32, 2, 3, 1, 3, 16);
    r.set_causal(true);
    r.set_return_lse(true);
    r.set_window_left(2);
    r.set_softmax_scale(0.5f);
    seeds.emplace_back("step_extend_f32_window_lse", SessionInput(kStep, f32, 1, 16, 4, r));
  }
  {
    StepRequest r;
    AddEntry(&r, "a", bf16, 1, 2, 1, 0, 4);
    seeds.emplace_back("step_bf16_q_only", SessionInput(kStep, bf16, 1, 4, 2, r));
  }
  {
    StepRequest r;
    AddEntry(&r, "a", f32, 1, 1, 1, 1, 8);
    AddEntry(&r, "a", f32, 1, 1, 1, 1, 8);
    seeds.emplace_back("step_bad_duplicate_session", SessionInput(kStep, f32, 1, 8, 1, r));
  }
  {
    StepRequest r;
    AddEntry(&r, "a", f32, 1, 4, 1, 1, 8);
    seeds.emplace_back("step_bad_too_many_queries", SessionInput(kStep, f32, 1, 8, 2, r));
  }
  {
    StepRequest r;
    AddEntry(&r, "a", f16, 3, 1, 2, 0, 8);
    r.set_window_right(-2);
    seeds.emplace_back("step_bad_heads_window", SessionInput(kStep, f16, 2, 8, 3, r));
  }

  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  for (const auto& [name, input] : seeds) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    out.write(input.data(), static_cast<std::streamsize>(input.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
  return 0;
}
