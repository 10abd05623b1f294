// Checks of Sessions requests (session_request.h): each malformed field is refused
// INVALID_ARGUMENT with a message naming the field, the expected and the actual value (token ids:
// one per row, and a prefix without rows); valid rows come out with the strides of their layout.
#include "server/requests/session_request.h"

#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

constexpr KvShape kShape{.dtype = DType::kFloat16, .heads_kv = 2, .head_dim = 8};

v1::Tensor MakeTensor(v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  t.mutable_data()->assign(n, '\x3c');
  return t;
}

void ExpectInvalid(const absl::Status& status, const std::string& text) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr(text));
}

TEST(ReplicaNameTest, OneToThirtyTwoOfLowerCaseDigitsAndDash) {
  EXPECT_TRUE(IsReplicaName("r1"));
  EXPECT_TRUE(IsReplicaName("attention-0"));
  EXPECT_TRUE(IsReplicaName(std::string(32, 'a')));
  EXPECT_FALSE(IsReplicaName(""));
  EXPECT_FALSE(IsReplicaName(std::string(33, 'a')));
  EXPECT_FALSE(IsReplicaName("R1"));
  EXPECT_FALSE(IsReplicaName("r.1"));
  EXPECT_FALSE(IsReplicaName("r_1"));
}

TEST(DecodeCreateTest, ChecksDtypeHeadsAndHeadDim) {
  v1::CreateSessionRequest request;
  request.set_dtype(v1::DTYPE_FLOAT16);
  request.set_kv_heads(2);
  request.set_head_dim(8);
  absl::StatusOr<DecodedCreate> ok = DecodeCreate(request, {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->rows.rows, 0);
  EXPECT_EQ(ok->shape.heads_kv, 2);

  v1::CreateSessionRequest bad = request;
  bad.set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(DecodeCreate(bad, {}).status(),
                "dtype: expected DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or "
                "DTYPE_FLOAT8_E4M3, got DTYPE_UNSPECIFIED");
  // float8 is an Attend dtype: no session holds float8 rows.
  bad = request;
  bad.set_dtype(v1::DTYPE_FLOAT8_E4M3);
  const absl::Status fp8 = DecodeCreate(bad, {}).status();
  EXPECT_EQ(fp8.code(), absl::StatusCode::kUnimplemented) << fp8;
  EXPECT_THAT(fp8.message(), HasSubstr("DTYPE_FLOAT8_E4M3 sessions are not implemented"));
  bad = request;
  bad.set_kv_heads(0);
  ExpectInvalid(DecodeCreate(bad, {}).status(), "kv_heads: expected >= 1, got 0");
  bad = request;
  bad.set_head_dim(300);
  ExpectInvalid(DecodeCreate(bad, {.max_head_dim = 256}).status(),
                "head_dim: expected 1..256, got 300");
  bad = request;
  *bad.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 5, 8});
  ExpectInvalid(DecodeCreate(bad, {}).status(), "v: expected a tensor (k and v come together)");
  bad = request;
  bad.set_v_head_dim(-1);
  ExpectInvalid(DecodeCreate(bad, {.max_head_dim = 256}).status(),
                "v_head_dim: expected 0..256 (0: head_dim), got -1");
  bad.set_v_head_dim(257);
  ExpectInvalid(DecodeCreate(bad, {.max_head_dim = 256}).status(),
                "v_head_dim: expected 0..256 (0: head_dim), got 257");
}

TEST(DecodeCreateTest, VHeadDimOfItsOwn) {
  v1::CreateSessionRequest request;
  request.set_dtype(v1::DTYPE_FLOAT16);
  request.set_kv_heads(2);
  request.set_head_dim(8);
  // Absent: v's head dim is head_dim.
  EXPECT_EQ(DecodeCreate(request, {}).value().shape.value_head_dim(), 8);
  request.set_v_head_dim(4);
  *request.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {5, 2, 8});
  *request.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {5, 2, 4});
  request.set_layout(v1::LAYOUT_BSHD);
  absl::StatusOr<DecodedCreate> ok = DecodeCreate(request, {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->shape.value_head_dim(), 4);
  EXPECT_EQ(ok->rows.rows, 5);
  EXPECT_EQ(ok->rows.head_stride, 8);  // k's: v's are VStride's, 4 and 2 * 4
  EXPECT_EQ(ok->rows.row_stride, 2 * 8);
  EXPECT_EQ(VStride(ok->shape, ok->rows.row_stride), 2 * 4);
  // v of the QK head dim where the session's Dv is 4.
  *request.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {5, 2, 8});
  ExpectInvalid(DecodeCreate(request, {}).status(),
                "v.shape[2] (v head dim): expected 4 (the session's v_head_dim), got 8");
}

TEST(DecodeCreateTest, TokensOnePerRowAndAPrefixWithoutRows) {
  v1::CreateSessionRequest request;
  request.set_dtype(v1::DTYPE_FLOAT16);
  request.set_kv_heads(2);
  request.set_head_dim(8);
  *request.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 3, 8});
  *request.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 3, 8});
  for (int64_t t : {7, 8, 9}) request.add_tokens(t);
  absl::StatusOr<DecodedCreate> named = DecodeCreate(request, {});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->tokens, (std::vector<int64_t>{7, 8, 9}));

  v1::CreateSessionRequest bad = request;
  bad.add_tokens(10);
  ExpectInvalid(DecodeCreate(bad, {}).status(),
                "tokens: expected none or 3 (one token id per row of k and v), got 4");
  bad = request;
  bad.add_prefix_tokens(7);
  ExpectInvalid(DecodeCreate(bad, {}).status(), "k, v: expected none with prefix_tokens");
  // A prefix alone, on a session of several layers too.
  v1::CreateSessionRequest prefix;
  prefix.set_dtype(v1::DTYPE_FLOAT16);
  prefix.set_kv_heads(2);
  prefix.set_head_dim(8);
  prefix.set_layers(3);
  for (int64_t t : {7, 8}) prefix.add_prefix_tokens(t);
  absl::StatusOr<DecodedCreate> found = DecodeCreate(prefix, {});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->prefix_tokens, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(found->layers, 3);
  EXPECT_TRUE(found->tokens.empty());
}

TEST(DecodeImportTest, HeaderThenChunksNamedByTheirFields) {
  v1::SessionChunk first;
  v1::SessionHeader* header = first.mutable_header();
  header->set_dtype(v1::DTYPE_FLOAT16);
  header->set_kv_heads(2);
  header->set_head_dim(8);
  header->set_layers(2);
  header->add_layer_lengths(5);
  header->add_layer_lengths(0);
  absl::StatusOr<DecodedImportHeader> ok = DecodeImportHeader(first, {});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->layers, 2);
  EXPECT_EQ(ok->lengths, (std::vector<int64_t>{5, 0}));
  EXPECT_EQ(ok->id, "");

  v1::SessionChunk bad = first;
  bad.mutable_header()->set_head_dim(0);
  ExpectInvalid(DecodeImportHeader(bad, {}).status(), "header.head_dim: expected 1..256, got 0");
  bad = first;
  bad.mutable_header()->set_layer_lengths(0, -1);
  ExpectInvalid(DecodeImportHeader(bad, {}).status(),
                "header.layer_lengths[0]: expected 0..2147483647, got -1");
  bad = first;
  bad.mutable_header()->set_session_id("ABC");
  const std::string expected =
      "header.session_id: expected 32 lower-case hex digits, alone or after a replica name and a "
      "'.', or none, got ";
  ExpectInvalid(DecodeImportHeader(bad, {}).status(), expected + "'ABC'");
  bad.mutable_header()->set_session_id("R1." + std::string(32, 'f'));
  ExpectInvalid(DecodeImportHeader(bad, {}).status(),
                expected + "'R1." + std::string(32, 'f') + "'");
  bad.mutable_header()->set_session_id("r1." + std::string(31, 'f'));
  ExpectInvalid(DecodeImportHeader(bad, {}).status(),
                expected + "'r1." + std::string(31, 'f') + "'");
  bad.mutable_header()->set_session_id(std::string(32, 'f'));
  EXPECT_TRUE(DecodeImportHeader(bad, {}).ok());
  bad.mutable_header()->set_session_id("r-1." + std::string(32, 'f'));
  absl::StatusOr<DecodedImportHeader> named = DecodeImportHeader(bad, {});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->id, "r-1." + std::string(32, 'f'));
  bad = first;
  *bad.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 1, 8});
  ExpectInvalid(DecodeImportHeader(bad, {}).status(), "k: expected none in the header's message");
  ExpectInvalid(DecodeImportHeader(v1::SessionChunk(), {}).status(),
                "header: expected the session's header in the first message, got none");

  v1::SessionChunk chunk;
  chunk.set_layer(1);
  chunk.set_first_row(3);
  *chunk.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 4, 8});
  *chunk.mutable_v() = chunk.k();
  absl::StatusOr<DecodedImportChunk> rows = DecodeImportChunk(chunk, ok->shape);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(std::tie(rows->layer, rows->first_row, rows->rows.rows), std::tuple(1, 3, 4));
  ExpectInvalid(DecodeImportChunk(first, ok->shape).status(),
                "header: expected it in the first message only");
  *chunk.mutable_v() = MakeTensor(v1::DTYPE_FLOAT32, {2, 4, 8});
  ExpectInvalid(DecodeImportChunk(chunk, ok->shape).status(),
                "v.dtype: expected DTYPE_FLOAT16 (the session's), got DTYPE_FLOAT32");
}

TEST(DecodeChunkRowsTest, AsAskedWithinTheMessageLimit) {
  const KvShape shape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 64};  // 1 KiB a row
  EXPECT_EQ(DecodeChunkRows(7, shape, 1 << 20).value(), 7);
  EXPECT_EQ(DecodeChunkRows(0, shape, int64_t{1} << 30).value(), 4095);  // 4 MiB less overhead
  EXPECT_EQ(DecodeChunkRows(0, shape, 1 << 20).value(), 1023);
  ExpectInvalid(DecodeChunkRows(1024, shape, 1 << 20).status(), "chunk_rows: expected 0..1023 ");
  ExpectInvalid(DecodeChunkRows(-1, shape, 1 << 20).status(), "chunk_rows: expected 0..1023 ");
}

TEST(DecodeKvRowsTest, StridesFollowTheLayout) {
  const v1::Tensor bhsd = MakeTensor(v1::DTYPE_FLOAT16, {2, 5, 8});
  absl::StatusOr<KvRows> rows = DecodeKvRows("", &bhsd, &bhsd, v1::LAYOUT_BHSD, kShape);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->rows, 5);
  EXPECT_EQ(rows->head_stride, 5 * 8);
  EXPECT_EQ(rows->row_stride, 8);
  const v1::Tensor bshd = MakeTensor(v1::DTYPE_FLOAT16, {5, 2, 8});
  rows = DecodeKvRows("", &bshd, &bshd, v1::LAYOUT_BSHD, kShape);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->rows, 5);
  EXPECT_EQ(rows->head_stride, 8);
  EXPECT_EQ(rows->row_stride, 2 * 8);
}

TEST(DecodeKvRowsTest, NamesTheFieldExpectedAndActual) {
  const v1::Tensor good = MakeTensor(v1::DTYPE_FLOAT16, {2, 5, 8});
  const v1::Tensor heads = MakeTensor(v1::DTYPE_FLOAT16, {3, 5, 8});
  ExpectInvalid(DecodeKvRows("entries[1].", &heads, &heads, v1::LAYOUT_BHSD, kShape).status(),
                "entries[1].k.shape[0] (kv heads): expected 2 (the session's), got 3");
  const v1::Tensor dim = MakeTensor(v1::DTYPE_FLOAT16, {2, 5, 16});
  ExpectInvalid(DecodeKvRows("", &good, &dim, v1::LAYOUT_BHSD, kShape).status(),
                "v.shape[2] (v head dim): expected 8 (the session's v_head_dim), got 16");
  const v1::Tensor f32 = MakeTensor(v1::DTYPE_FLOAT32, {2, 5, 8});
  ExpectInvalid(DecodeKvRows("", &f32, &f32, v1::LAYOUT_BHSD, kShape).status(),
                "k.dtype: expected DTYPE_FLOAT16 (the session's), got DTYPE_FLOAT32");
  v1::Tensor short_data = good;
  short_data.mutable_data()->pop_back();
  ExpectInvalid(DecodeKvRows("", &good, &short_data, v1::LAYOUT_BHSD, kShape).status(),
                "v.data: expected 160 bytes");
  const v1::Tensor other_rows = MakeTensor(v1::DTYPE_FLOAT16, {2, 6, 8});
  ExpectInvalid(DecodeKvRows("", &good, &other_rows, v1::LAYOUT_BHSD, kShape).status(),
                "v.shape[1] (rows): expected 5 (as k), got 6");
  const v1::Tensor rank2 = MakeTensor(v1::DTYPE_FLOAT16, {2, 40});
  ExpectInvalid(DecodeKvRows("", &rank2, &rank2, v1::LAYOUT_BHSD, kShape).status(),
                "k.shape: expected rank 3 ([Hkv, n, D]), got rank 2 [2, 40]");
  ExpectInvalid(DecodeKvRows("", &good, &good, static_cast<v1::Layout>(7), kShape).status(),
                "layout: expected LAYOUT_BHSD or LAYOUT_BSHD, got 7");
}

v1::StepRequest TwoEntries() {
  v1::StepRequest request;
  for (const char* id : {"a", "b"}) {
    v1::StepEntry* entry = request.add_entries();
    entry->set_session_id(id);
    *entry->mutable_q() = MakeTensor(v1::DTYPE_FLOAT16, {4, 1, 8});
  }
  return request;
}

TEST(CheckStepTest, RefusesMissingAndRepeatedSessionsAndBadMasks) {
  EXPECT_EQ(CheckStep(TwoEntries()), absl::OkStatus());
  ExpectInvalid(
      CheckStep(v1::StepRequest()),
      "entries: expected at least one entry (or the packed form's session_ids), got none");
  v1::StepRequest request = TwoEntries();
  request.mutable_entries(1)->set_session_id("a");
  ExpectInvalid(CheckStep(request),
                "entries[1].session_id: expected each session at most once per step, got 'a'");
  request = TwoEntries();
  request.mutable_entries(0)->clear_session_id();
  ExpectInvalid(CheckStep(request), "entries[0].session_id: expected a session id, got none");
  request = TwoEntries();
  request.mutable_entries(1)->clear_q();
  ExpectInvalid(CheckStep(request), "entries[1].q: expected a tensor [Hq, Nq, D], got none");
  request = TwoEntries();
  request.set_window_left(-2);
  ExpectInvalid(CheckStep(request), "window_left: expected >= 0 (absent = unbounded), got -2");
  request = TwoEntries();
  request.set_softmax_scale(0);
  ExpectInvalid(CheckStep(request), "softmax_scale: expected a finite value > 0, got 0");
  request = TwoEntries();
  request.set_softmax_scale(3e38f);
  ExpectInvalid(CheckStep(request),
                "softmax_scale: expected at most 1e+06 (larger scales cannot be computed "
                "accurately), got 3e+38");
  request = TwoEntries();
  request.set_softmax_scale(1e6f);
  EXPECT_TRUE(CheckStep(request).ok());
}

TEST(DecodeStepEntryTest, ChecksQueriesAgainstTheSession) {
  v1::StepEntry entry = TwoEntries().entries(0);
  *entry.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 1, 8});
  *entry.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 1, 8});
  absl::StatusOr<DecodedEntry> ok = DecodeStepEntry(0, entry, kShape);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->heads_q, 4);
  EXPECT_EQ(ok->rows_q, 1);
  EXPECT_EQ(ok->rows.rows, 1);

  v1::StepEntry bad = entry;
  *bad.mutable_q() = MakeTensor(v1::DTYPE_FLOAT16, {3, 1, 8});
  ExpectInvalid(DecodeStepEntry(2, bad, kShape).status(),
                "entries[2].q.shape[0] (query heads): expected a multiple of the session's 2 kv "
                "heads, got 3");
  bad = entry;
  *bad.mutable_q() = MakeTensor(v1::DTYPE_FLOAT16, {4, 3, 8});
  absl::StatusOr<DecodedEntry> three_queries = DecodeStepEntry(0, bad, kShape);
  ASSERT_TRUE(three_queries.ok()) << three_queries.status();
  EXPECT_EQ(three_queries->rows_q, 3);  // checked against the session's length on the worker
  bad = entry;
  *bad.mutable_q() = MakeTensor(v1::DTYPE_BFLOAT16, {4, 1, 8});
  ExpectInvalid(DecodeStepEntry(0, bad, kShape).status(),
                "entries[0].q.dtype: expected DTYPE_FLOAT16 (the session's), got DTYPE_BFLOAT16");
  bad = entry;
  *bad.mutable_q() = MakeTensor(v1::DTYPE_FLOAT16, {4, 1, 4});
  ExpectInvalid(DecodeStepEntry(0, bad, kShape).status(),
                "entries[0].q.shape[2] (head dim): expected 8 (the session's), got 4");
  bad = entry;
  bad.clear_v();
  ExpectInvalid(DecodeStepEntry(0, bad, kShape).status(),
                "entries[0].v: expected a tensor (k and v come together), got none");
}

TEST(DecodeStepEntryTest, VAndOTakeTheSessionsVHeadDim) {
  KvShape shape = kShape;
  shape.v_head_dim = 4;
  v1::StepEntry entry = TwoEntries().entries(0);  // q [4, 1, 8]
  *entry.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 3, 8});
  *entry.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 3, 4});
  absl::StatusOr<DecodedEntry> ok = DecodeStepEntry(0, entry, shape);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->q_bytes, 4 * 1 * 8 * 2);
  EXPECT_EQ(ok->o_bytes, 4 * 1 * 4 * 2);
  EXPECT_EQ(ok->k_bytes, 2 * 3 * 8 * 2);
  EXPECT_EQ(ok->v_bytes, 2 * 3 * 4 * 2);
  *entry.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 3, 8});
  ExpectInvalid(DecodeStepEntry(1, entry, shape).status(),
                "entries[1].v.shape[2] (v head dim): expected 4 (the session's v_head_dim), got 8");

  // Packed: v [B, Hkv, n, Dv], and o [B, Hq, Nq, Dv] (o_bytes per sequence).
  v1::StepRequest packed;
  packed.add_session_ids("a");
  packed.add_session_ids("b");
  *packed.mutable_q() = MakeTensor(v1::DTYPE_FLOAT16, {2, 4, 1, 8});
  *packed.mutable_k() = MakeTensor(v1::DTYPE_FLOAT16, {2, 2, 1, 8});
  *packed.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 2, 1, 4});
  absl::StatusOr<DecodedPacked> step = DecodePackedStep(packed, shape);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->entries.size(), 2u);
  EXPECT_EQ(step->entries[1].o_bytes, 4 * 1 * 4 * 2);
  EXPECT_EQ(static_cast<const char*>(step->entries[1].rows.v) -
                static_cast<const char*>(step->entries[0].rows.v),
            2 * 1 * 4 * 2);
  *packed.mutable_v() = MakeTensor(v1::DTYPE_FLOAT16, {2, 2, 1, 8});
  ExpectInvalid(DecodePackedStep(packed, shape).status(),
                "v.shape[3] (v head dim): expected 4 (the sessions' v_head_dim), got 8");
}

}  // namespace
}  // namespace attention::server
