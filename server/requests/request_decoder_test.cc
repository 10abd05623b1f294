#include "server/requests/request_decoder.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using v1::AttendRequest;
using v1::AttendResponse;

// Fresh random bytes each run; the seed is printed by the test that fails.
class Random {
 public:
  Random() : seed_(std::random_device{}()), gen_(seed_) {}
  unsigned seed() const { return seed_; }
  std::string Bytes(size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(gen_() & 0xff);
    return s;
  }
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }

 private:
  unsigned seed_;
  std::mt19937 gen_;
};

size_t Bytes(v1::DType dtype) {
  return dtype == v1::DTYPE_FLOAT32 ? 4 : dtype == v1::DTYPE_FLOAT8_E4M3 ? 1 : 2;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, Random& random) {
  t->set_dtype(dtype);
  t->clear_shape();
  int64_t n = Bytes(dtype);
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  t->set_data(random.Bytes(static_cast<size_t>(n)));
}

// q [2, 4, 5, 8], k and v [2, 2, 7, 8], float32, BHSD.
AttendRequest DenseRequest(Random& random) {
  AttendRequest r;
  r.set_request_id("r1");
  SetTensor(r.mutable_q(), v1::DTYPE_FLOAT32, {2, 4, 5, 8}, random);
  SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {2, 2, 7, 8}, random);
  SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 7, 8}, random);
  return r;
}

// DenseRequest's shapes in float8 e4m3.
void MakeFloat8(AttendRequest& r, Random& random) {
  SetTensor(r.mutable_q(), v1::DTYPE_FLOAT8_E4M3, {2, 4, 5, 8}, random);
  SetTensor(r.mutable_k(), v1::DTYPE_FLOAT8_E4M3, {2, 2, 7, 8}, random);
  SetTensor(r.mutable_v(), v1::DTYPE_FLOAT8_E4M3, {2, 2, 7, 8}, random);
}

// Two items: q rows 3 + 4, k rows 5 + 4; q [7, 4, 8], k and v [9, 2, 8].
AttendRequest VarlenRequest(Random& random) {
  AttendRequest r;
  SetTensor(r.mutable_q(), v1::DTYPE_FLOAT16, {7, 4, 8}, random);
  SetTensor(r.mutable_k(), v1::DTYPE_FLOAT16, {9, 2, 8}, random);
  SetTensor(r.mutable_v(), v1::DTYPE_FLOAT16, {9, 2, 8}, random);
  for (int x : {0, 3, 7}) r.add_cu_seqlens_q(x);
  for (int x : {0, 5, 9}) r.add_cu_seqlens_k(x);
  return r;
}

struct ErrorCase {
  std::string name;
  bool varlen;
  std::function<void(AttendRequest&, Random&)> mutate;
  absl::StatusCode code;
  std::string message;  // a substring of the status message
  int64_t max_message_bytes = int64_t{1} << 30;
};

TEST(RequestDecoderTest, RejectsMalformedRequestsNamingTheField) {
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<ErrorCase> cases = {
      {"missing q", false, [](auto& r, auto&) { r.clear_q(); }, kInvalid,
       "q: expected a tensor, got none"},
      {"missing v", false, [](auto& r, auto&) { r.clear_v(); }, kInvalid,
       "v: expected a tensor, got none"},
      {"dtype unspecified", false,
       [](auto& r, auto&) { r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); }, kInvalid,
       "q.dtype: expected DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT8_E4M3, got "
       "DTYPE_UNSPECIFIED"},
      {"dtype unknown", false,
       [](auto& r, auto&) { r.mutable_q()->set_dtype(static_cast<v1::DType>(9)); }, kInvalid,
       "got unknown dtype 9"},
      {"dtype mismatch", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT16, {2, 2, 7, 8}, g);
       },
       kInvalid, "k.dtype: expected DTYPE_FLOAT32 (as q), got DTYPE_FLOAT16"},
      {"bad layout", false, [](auto& r, auto&) { r.set_layout(static_cast<v1::Layout>(5)); },
       kInvalid, "layout: expected LAYOUT_BHSD or LAYOUT_BSHD, got 5"},
      {"bad mask_alignment", false,
       [](auto& r, auto&) { r.set_mask_alignment(static_cast<v1::MaskAlignment>(2)); }, kInvalid,
       "mask_alignment: expected MASK_ALIGN_BOTTOM_RIGHT or MASK_ALIGN_TOP_LEFT, got 2"},
      {"dense rank", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_q(), v1::DTYPE_FLOAT32, {2, 4, 40}, g);
       },
       kInvalid, "q.shape: expected rank 4 ([B, H, N, D] for LAYOUT_BHSD), got rank 3 [2, 4, 40]"},
      {"bshd rank", false,
       [](auto& r, auto& g) {
         r.set_layout(v1::LAYOUT_BSHD);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 7, 8, 1}, g);
       },
       kInvalid, "v.shape: expected rank 4 ([B, N, H, D] for LAYOUT_BSHD), got rank 5"},
      {"zero dim", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {2, 2, 0, 8}, g);
       },
       kInvalid, "k.shape[2]: expected > 0, got 0"},
      {"negative dim", false, [](auto& r, auto&) { r.mutable_q()->set_shape(3, -8); }, kInvalid,
       "q.shape[3]: expected > 0, got -8"},
      {"overflowing dims", false,
       [](auto& r, auto&) {
         for (int i = 0; i < 4; ++i) r.mutable_q()->set_shape(i, int64_t{1} << 20);
       },
       kInvalid, "q.shape: expected a size that fits int64, got [1048576, 1048576, 1048576, "},
      {"byte size", false, [](auto& r, auto&) { r.mutable_v()->mutable_data()->pop_back(); },
       kInvalid, "v.data: expected 896 bytes (shape [2, 2, 7, 8] x 4 bytes), got 895"},
      {"batch mismatch", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {3, 2, 7, 8}, g);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {3, 2, 7, 8}, g);
       },
       kInvalid, "k.shape[0] (batch): expected 2 (as q), got 3"},
      {"head dim mismatch", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {2, 2, 7, 16}, g);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 7, 16}, g);
       },
       kInvalid, "k.shape[3] (head dim): expected 8 (as q), got 16"},
      {"k and v differ", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 6, 8}, g);
       },
       kInvalid, "v.shape: expected [2, 2, 7, 8] (as k, but for the head dim), got [2, 2, 6, 8]"},
      {"v head dim over the limit", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 7, 257}, g);
       },
       kInvalid, "v.shape[3] (head dim): expected 1..256, got 257"},
      {"sinks not one per query head", false,
       [](auto& r, auto&) {
         r.add_sinks(0.5f);
         r.add_sinks(1.0f);
       },
       kInvalid, "sinks: expected 4 values (one per query head), got 2"},
      {"sink not finite", false,
       [](auto& r, auto&) {
         for (float x : {0.0f, 1.0f, std::numeric_limits<float>::infinity(), 2.0f}) r.add_sinks(x);
       },
       kInvalid, "sinks[2]: expected a finite logit, got inf"},
      {"softcap zero", false, [](auto& r, auto&) { r.set_softcap(0.0f); }, kInvalid,
       "softcap: expected a finite value > 0, got 0"},
      {"chunk_size negative", false, [](auto& r, auto&) { r.set_chunk_size(-3); }, kInvalid,
       "chunk_size: expected > 0 (absent = no chunks), got -3"},
      {"heads not divisible", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {2, 3, 7, 8}, g);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 3, 7, 8}, g);
       },
       kInvalid, "k.shape[1] (heads): expected a divisor of q's 4 heads, got 3"},
      {"head dim too large", false,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_q(), v1::DTYPE_FLOAT32, {1, 1, 1, 300}, g);
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {1, 1, 1, 300}, g);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {1, 1, 1, 300}, g);
       },
       kInvalid, "q.shape[3] (head dim): expected 1..256, got 300"},
      {"nan scale", false,
       [](auto& r, auto&) { r.set_softmax_scale(std::numeric_limits<float>::quiet_NaN()); },
       kInvalid, "softmax_scale: expected a finite value > 0, got nan"},
      {"infinite scale", false,
       [](auto& r, auto&) { r.set_softmax_scale(std::numeric_limits<float>::infinity()); },
       kInvalid, "softmax_scale: expected a finite value > 0, got inf"},
      {"zero scale", false, [](auto& r, auto&) { r.set_softmax_scale(0); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got 0"},
      {"huge scale", false, [](auto& r, auto&) { r.set_softmax_scale(3e38f); }, kInvalid,
       "softmax_scale: expected at most 1e+06 (larger scales cannot be computed accurately), got "
       "3e+38"},
      {"scale above the bound", false, [](auto& r, auto&) { r.set_softmax_scale(1e7f); }, kInvalid,
       "softmax_scale: expected at most 1e+06 (larger scales cannot be computed accurately), got "
       "1e+07"},
      {"descale without float8", false, [](auto& r, auto&) { r.set_k_descale(0.5f); }, kInvalid,
       "k_descale: expected only with DTYPE_FLOAT8_E4M3 inputs, got 0.5 with DTYPE_FLOAT32"},
      {"float8 and bfloat16", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         SetTensor(r.mutable_v(), v1::DTYPE_BFLOAT16, {2, 2, 7, 8}, g);
       },
       kInvalid, "v.dtype: expected DTYPE_FLOAT8_E4M3 (as q), got DTYPE_BFLOAT16"},
      {"float8 byte size", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.mutable_k()->mutable_data()->pop_back();
       },
       kInvalid, "k.data: expected 224 bytes (shape [2, 2, 7, 8] x 1 bytes), got 223"},
      {"nan q_descale", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.set_q_descale(std::numeric_limits<float>::quiet_NaN());
       },
       kInvalid, "q_descale: expected a finite value > 0, got nan"},
      {"infinite k_descale", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.set_k_descale(std::numeric_limits<float>::infinity());
       },
       kInvalid, "k_descale: expected a finite value > 0, got inf"},
      {"zero v_descale", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.set_v_descale(0);
       },
       kInvalid, "v_descale: expected a finite value > 0, got 0"},
      {"negative v_descale", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.set_v_descale(-2);
       },
       kInvalid, "v_descale: expected a finite value > 0, got -2"},
      {"descaled logits above the bound", false,
       [](auto& r, auto& g) {
         MakeFloat8(r, g);
         r.set_softmax_scale(0.5f);
         r.set_q_descale(4e3f);
         r.set_k_descale(1e3f);
       },
       kInvalid,
       "q_descale * k_descale * softmax_scale: expected at most 1e+06 (the scale of the raw "
       "logits; larger cannot be computed accurately), got 2e+06 (q_descale 4000, k_descale 1000, "
       "softmax_scale 0.5)"},
      {"negative window_left", false, [](auto& r, auto&) { r.set_window_left(-1); }, kInvalid,
       "window_left: expected >= 0 (absent = unbounded), got -1"},
      {"negative window_right", false, [](auto& r, auto&) { r.set_window_right(-4); }, kInvalid,
       "window_right: expected >= 0 (absent = unbounded), got -4"},
      {"cu_seqlens_k missing", true, [](auto& r, auto&) { r.clear_cu_seqlens_k(); }, kInvalid,
       "cu_seqlens_k: expected B+1 offsets (cu_seqlens_q and cu_seqlens_k come together)"},
      {"cu_seqlens_q missing", true, [](auto& r, auto&) { r.clear_cu_seqlens_q(); }, kInvalid,
       "cu_seqlens_q: expected B+1 offsets"},
      {"varlen rank", true,
       [](auto& r, auto& g) {
         SetTensor(r.mutable_q(), v1::DTYPE_FLOAT16, {1, 7, 4, 8}, g);
       },
       kInvalid, "q.shape: expected rank 3 ([total, H, D] with cu_seqlens), got rank 4"},
      {"cu_seqlens one offset", true,
       [](auto& r, auto&) {
         r.mutable_cu_seqlens_q()->Truncate(1);
         r.mutable_cu_seqlens_k()->Truncate(1);
       },
       kInvalid, "cu_seqlens_q: expected at least 2 offsets (B+1), got 1"},
      {"cu_seqlens length", true, [](auto& r, auto&) { r.add_cu_seqlens_k(10); }, kInvalid,
       "cu_seqlens_k: expected 3 offsets (B+1, as cu_seqlens_q), got 4"},
      {"cu_seqlens start", true, [](auto& r, auto&) { r.set_cu_seqlens_q(0, 1); }, kInvalid,
       "cu_seqlens_q[0]: expected 0, got 1"},
      {"cu_seqlens decreasing", true, [](auto& r, auto&) { r.set_cu_seqlens_k(1, 0); }, kInvalid,
       "cu_seqlens_k[1]: expected > cu_seqlens_k[0] = 0 (offsets increase; every item needs at "
       "least one row), got 0"},
      {"cu_seqlens empty item", true, [](auto& r, auto&) { r.set_cu_seqlens_q(1, 7); }, kInvalid,
       "cu_seqlens_q[2]: expected > cu_seqlens_q[1] = 7"},
      {"cu_seqlens last", true, [](auto& r, auto&) { r.set_cu_seqlens_k(2, 8); }, kInvalid,
       "cu_seqlens_k[2]: expected 9 (k.shape[0], the packed rows), got 8"},
      {"request over the limit", false, [](auto&, auto&) {}, absl::StatusCode::kResourceExhausted,
       "request tensors are 3072 bytes, over the message limit of 3000 bytes", 3000},
      // Request 1280 + 2 * 128 bytes; response o 1280 + lse 160 + id 2 + 1024 overhead.
      {"response over the limit", false,
       [](auto& r, auto& g) {
         r.set_return_lse(true);
         SetTensor(r.mutable_k(), v1::DTYPE_FLOAT32, {2, 2, 1, 8}, g);
         SetTensor(r.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 1, 8}, g);
       },
       absl::StatusCode::kResourceExhausted,
       "response would be 2466 bytes, over the message limit of 2000 bytes", 2000},
  };
  Random random;
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.name + ", seed " + std::to_string(random.seed()));
    AttendRequest request = c.varlen ? VarlenRequest(random) : DenseRequest(random);
    c.mutate(request, random);
    AttendResponse response;
    absl::StatusOr<DecodedRequest> decoded =
        DecodeRequest(request, DecodeOptions{.max_message_bytes = c.max_message_bytes}, &response);
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), c.code) << decoded.status();
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.message));
  }
}

// The flat element index the params' strides give for (b, h, i, d), following the indexing rule
// in attention_params.h.
int64_t QIndex(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t d) {
  const int64_t row = p.is_varlen() ? p.cu_seqlens_q[b] + i : i;
  return b * p.q_batch_stride + row * p.q_row_stride + h * p.q_head_stride + d;
}
int64_t KIndex(const AttentionParams& p, int64_t b, int64_t h, int64_t j, int64_t d) {
  const int64_t row = p.is_varlen() ? p.cu_seqlens_k[b] + j : j;
  return b * p.k_batch_stride + row * p.k_row_stride + h * p.k_head_stride + d;
}
int64_t LseIndex(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  const int64_t row = p.is_varlen() ? p.cu_seqlens_q[b] + i : i;
  return b * p.lse_batch_stride + h * p.lse_head_stride + row;
}

TEST(RequestDecoderTest, ShapesWhoseBytesOverflowTogetherAreRefusedWithoutANegativeCount) {
  // AttendChunked's header: the bytes are still to come, so the shapes alone give them. q, k and
  // v float32 [2^30, 1, 2^22, 256] are 2^62 bytes each: their sum passes int64.
  AttendRequest request;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : {int64_t{1} << 30, int64_t{1}, int64_t{1} << 22, int64_t{256}}) {
      t->add_shape(d);
    }
  }
  const absl::StatusOr<DecodedRequest> decoded =
      DecodeRequest(request, InputTensors{.q_bytes = -1, .k_bytes = -1, .v_bytes = -1},
                    DecodeOptions{.max_message_bytes = int64_t{8} << 30});
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kResourceExhausted) << decoded.status();
  EXPECT_EQ(decoded.status().message(),
            "request tensors are more than 9223372036854775807 bytes, over the message limit of "
            "8589934592 bytes");
}

TEST(RequestDecoderTest, BhsdPointsIntoRequestAndResponse) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = DenseRequest(random);  // q [2, 4, 5, 8], k [2, 2, 7, 8]
  request.set_return_lse(true);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const AttentionParams& p = decoded->params;

  // No copies: the kernel reads the request's bytes and writes the response's.
  EXPECT_EQ(p.q, request.q().data().data());
  EXPECT_EQ(p.k, request.k().data().data());
  EXPECT_EQ(p.v, request.v().data().data());
  EXPECT_EQ(p.o, response.o().data().data());
  EXPECT_EQ(static_cast<const void*>(p.lse), response.lse().data().data());
  EXPECT_EQ(response.o().data().size(), request.q().data().size());
  EXPECT_THAT(response.o().shape(), ::testing::ElementsAre(2, 4, 5, 8));
  EXPECT_EQ(response.o().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_THAT(response.lse().shape(), ::testing::ElementsAre(2, 4, 5));
  EXPECT_EQ(response.lse().data().size(), 2 * 4 * 5 * sizeof(float));

  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.heads_q, 4);
  EXPECT_EQ(p.heads_kv, 2);
  EXPECT_EQ(p.seqlen_q, 5);
  EXPECT_EQ(p.seqlen_k, 7);
  EXPECT_EQ(p.head_dim, 8);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1 / std::sqrt(8.0f));
  EXPECT_EQ(p.window_left, kUnboundedWindow);
  EXPECT_EQ(p.window_right, kUnboundedWindow);
  // Row-major [B, H, N, D].
  for (int trial = 0; trial < 20; ++trial) {
    const int b = random.Int(0, 1), h = random.Int(0, 3), i = random.Int(0, 4),
              j = random.Int(0, 6), d = random.Int(0, 7);
    EXPECT_EQ(QIndex(p, b, h, i, d), ((b * 4 + h) * 5 + i) * 8 + d);
    EXPECT_EQ(KIndex(p, b, h / 2, j, d), ((b * 2 + h / 2) * 7 + j) * 8 + d);
    EXPECT_EQ(LseIndex(p, b, h, i), (b * 4 + h) * 5 + i);
  }
  // Unmasked: every query row sees every key.
  EXPECT_DOUBLE_EQ(decoded->flops, 4.0 * 2 * 4 * 5 * 7 * 8);
  EXPECT_EQ(decoded->query_tokens, 2 * 5);
}

TEST(RequestDecoderTest, Float8TakesDescalesAndAnswersBfloat16) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = DenseRequest(random);  // q [2, 4, 5, 8], k [2, 2, 7, 8]
  MakeFloat8(request, random);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->params.dtype, DType::kFloat8E4M3);
  EXPECT_EQ(decoded->params.q_descale, 1.0f);  // absent: 1
  EXPECT_EQ(decoded->params.k_descale, 1.0f);
  EXPECT_EQ(decoded->params.v_descale, 1.0f);
  EXPECT_EQ(decoded->q_bytes, 2 * 4 * 5 * 8);
  // o: q's shape in bfloat16, two bytes an element.
  EXPECT_EQ(response.o().dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_THAT(response.o().shape(), ::testing::ElementsAre(2, 4, 5, 8));
  EXPECT_EQ(response.o().data().size(), 2 * 4 * 5 * 8 * 2);
  EXPECT_EQ(decoded->params.o, response.o().data().data());

  request.set_q_descale(0.25f);
  request.set_k_descale(3.0f);
  request.set_v_descale(1e-3f);
  request.set_softmax_scale(0.7f);
  decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->params.q_descale, 0.25f);
  EXPECT_EQ(decoded->params.k_descale, 3.0f);
  EXPECT_EQ(decoded->params.v_descale, 1e-3f);
  EXPECT_EQ(decoded->params.softmax_scale, 0.7f);  // the descales are the kernels' to fold
  EXPECT_FLOAT_EQ(EffectiveSoftmaxScale(decoded->params), 0.7f * 0.25f * 3.0f);
}

TEST(RequestDecoderTest, BshdStrides) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request;
  request.set_layout(v1::LAYOUT_BSHD);
  SetTensor(request.mutable_q(), v1::DTYPE_BFLOAT16, {3, 6, 4, 16}, random);  // [B, Nq, Hq, D]
  SetTensor(request.mutable_k(), v1::DTYPE_BFLOAT16, {3, 9, 1, 16}, random);  // [B, Nk, Hkv, D]
  SetTensor(request.mutable_v(), v1::DTYPE_BFLOAT16, {3, 9, 1, 16}, random);
  request.set_softmax_scale(0.5f);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const AttentionParams& p = decoded->params;
  EXPECT_EQ(p.dtype, DType::kBFloat16);
  EXPECT_EQ(p.seqlen_q, 6);
  EXPECT_EQ(p.heads_q, 4);
  EXPECT_EQ(p.seqlen_k, 9);
  EXPECT_EQ(p.heads_kv, 1);
  EXPECT_EQ(p.softmax_scale, 0.5f);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_FALSE(response.has_lse());
  EXPECT_THAT(response.o().shape(), ::testing::ElementsAre(3, 6, 4, 16));
  for (int trial = 0; trial < 20; ++trial) {
    const int b = random.Int(0, 2), h = random.Int(0, 3), i = random.Int(0, 5),
              j = random.Int(0, 8), d = random.Int(0, 15);
    EXPECT_EQ(QIndex(p, b, h, i, d), ((b * 6 + i) * 4 + h) * 16 + d);
    EXPECT_EQ(KIndex(p, b, 0, j, d), (b * 9 + j) * 16 + d);
  }
}

// Scales up to kMaxSoftmaxScale are accepted as they are (the bound itself included); the cases
// above refuse larger ones.
TEST(RequestDecoderTest, AcceptsScalesUpToTheBound) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  for (float scale : {1e-30f, 100.0f, kMaxSoftmaxScale}) {
    AttendRequest request;
    SetTensor(request.mutable_q(), v1::DTYPE_FLOAT32, {1, 1, 4, 16}, random);
    SetTensor(request.mutable_k(), v1::DTYPE_FLOAT32, {1, 1, 4, 16}, random);
    SetTensor(request.mutable_v(), v1::DTYPE_FLOAT32, {1, 1, 4, 16}, random);
    request.set_softmax_scale(scale);
    AttendResponse response;
    absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->params.softmax_scale, scale);
  }
  EXPECT_EQ(kMaxSoftmaxScale, 1e6f);
}

TEST(RequestDecoderTest, VarlenOffsetsAndLse) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = VarlenRequest(random);  // q rows 3 + 4, k rows 5 + 4
  request.set_return_lse(true);
  request.set_causal(true);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const AttentionParams& p = decoded->params;
  ASSERT_TRUE(p.is_varlen());
  EXPECT_EQ(p.cu_seqlens_q, request.cu_seqlens_q().data());
  EXPECT_EQ(p.cu_seqlens_k, request.cu_seqlens_k().data());
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.total_q, 7);
  EXPECT_EQ(p.total_k, 9);
  EXPECT_EQ(p.seqlen_q, 4);  // the longest item
  EXPECT_EQ(p.seqlen_k, 5);
  EXPECT_EQ(p.window_right, 0);
  EXPECT_THAT(response.lse().shape(), ::testing::ElementsAre(4, 7));  // [Hq, total_q]
  for (int trial = 0; trial < 20; ++trial) {
    const int b = random.Int(0, 1), h = random.Int(0, 3), i = random.Int(0, 2),
              j = random.Int(0, 3), d = random.Int(0, 7);
    const int q_row = request.cu_seqlens_q(b) + i, k_row = request.cu_seqlens_k(b) + j;
    EXPECT_EQ(QIndex(p, b, h, i, d), (q_row * 4 + h) * 8 + d);
    EXPECT_EQ(KIndex(p, b, h / 2, j, d), (k_row * 2 + h / 2) * 8 + d);
    EXPECT_EQ(LseIndex(p, b, h, i), h * 7 + q_row);
  }
  // Causal, bottom-right: row i of an item sees i + Nk - Nq + 1 keys.
  // Item 0 (3 rows, 5 keys): 3 + 4 + 5; item 1 (4 rows, 4 keys): 1 + 2 + 3 + 4.
  EXPECT_DOUBLE_EQ(decoded->flops, 4.0 * 4 * 8 * (12 + 10));
  EXPECT_EQ(decoded->query_tokens, 7);
}

TEST(RequestDecoderTest, WindowsAndCausal) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = DenseRequest(random);  // Nq = 5, Nk = 7: diagonal of row i is i + 2
  request.set_window_left(1);
  request.set_window_right(3);
  request.set_causal(true);  // overrides window_right
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->params.window_left, 1);
  EXPECT_EQ(decoded->params.window_right, 0);
  // Row i sees keys i+1 .. i+2: 2 keys for each of 5 rows.
  EXPECT_DOUBLE_EQ(decoded->flops, 4.0 * 2 * 4 * 8 * (5 * 2));
  EXPECT_EQ(decoded->params.mask_alignment, MaskAlignment::kBottomRight);
}

TEST(RequestDecoderTest, OpenModelOptionsAndVHeadDim) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = DenseRequest(random);
  SetTensor(request.mutable_v(), v1::DTYPE_FLOAT32, {2, 2, 7, 3}, random);  // Dv = 3, D = 8
  for (float x : {0.5f, -1.0f, 2.0f, 0.0f}) request.add_sinks(x);
  request.set_softcap(30.0f);
  request.set_chunk_size(4);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  const AttentionParams& p = decoded->params;
  EXPECT_EQ(p.head_dim, 8);
  EXPECT_EQ(p.value_head_dim(), 3);
  EXPECT_EQ(p.v_row_stride, 3);
  EXPECT_EQ(p.o_head_stride, 5 * 3);
  EXPECT_EQ(p.sinks, request.sinks().data());
  EXPECT_EQ(p.softcap, 30.0f);
  EXPECT_EQ(p.chunk_size, 4);
  // o: q's shape with V's head dim, its bytes sized so.
  EXPECT_THAT(response.o().shape(), testing::ElementsAre(2, 4, 5, 3));
  EXPECT_EQ(response.o().data().size(), 2u * 4 * 5 * 3 * sizeof(float));
}

TEST(RequestDecoderTest, TopLeftAlignment) {
  Random random;
  SCOPED_TRACE("seed " + std::to_string(random.seed()));
  AttendRequest request = DenseRequest(random);  // Nq = 5, Nk = 7: diagonal of row i is i
  request.set_causal(true);
  request.set_mask_alignment(v1::MASK_ALIGN_TOP_LEFT);
  AttendResponse response;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &response);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->params.mask_alignment, MaskAlignment::kTopLeft);
  // Row i sees keys 0 .. i: 1 + 2 + 3 + 4 + 5 pairs.
  EXPECT_DOUBLE_EQ(decoded->flops, 4.0 * 2 * 4 * 8 * 15);
}

}  // namespace
}  // namespace attention::server
