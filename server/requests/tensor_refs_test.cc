// The decoders' side of tensors by reference: what a TensorRefResolver is asked for (fields,
// sizes, alignments) and that the decoded pointers are the bytes it answered; refusals before
// any resolution when a reference's size is not its shape's; FAILED_PRECONDITION without one;
// outputs overlapping an input or each other (Attend, Step entries, packed Step) refused naming
// both.
#include "server/requests/tensor_refs.h"

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/requests/request_decoder.h"
#include "server/requests/session_request.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// Answers every reference with bytes of its own buffer at the reference's offset, and records
// what it was asked.
class FakeRegions final : public TensorRefResolver {
 public:
  explicit FakeRegions(size_t bytes) : buffer_(bytes) {}
  absl::StatusOr<char*> Resolve(absl::string_view field, const v1::TensorRef& ref,
                                int64_t alignment) override {
    asked_[std::string(field)] = alignment;
    if (ref.region() != "r") return absl::NotFoundError(absl::StrCat(field, ".region: unknown"));
    return buffer_.data() + ref.offset();
  }
  char* at(int64_t offset) { return buffer_.data() + offset; }
  const std::map<std::string, int64_t>& asked() const { return asked_; }

 private:
  std::vector<char> buffer_;
  std::map<std::string, int64_t> asked_;
};

v1::Tensor RefTensor(v1::DType dtype, std::vector<int64_t> shape, int64_t offset, int64_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_ref()->set_region("r");
  t.mutable_ref()->set_offset(offset);
  t.mutable_ref()->set_byte_size(bytes);
  return t;
}

// q [1, 2, 3, 8] and k, v [1, 1, 5, 8] float16, all by reference; o and lse into the region.
v1::AttendRequest ByReference() {
  v1::AttendRequest r;
  *r.mutable_q() = RefTensor(v1::DTYPE_FLOAT16, {1, 2, 3, 8}, 0, 96);
  *r.mutable_k() = RefTensor(v1::DTYPE_FLOAT16, {1, 1, 5, 8}, 128, 80);
  *r.mutable_v() = RefTensor(v1::DTYPE_FLOAT16, {1, 1, 5, 8}, 256, 80);
  r.mutable_o_ref()->set_region("r");
  r.mutable_o_ref()->set_offset(384);
  r.mutable_o_ref()->set_byte_size(96);
  r.set_return_lse(true);
  r.mutable_lse_ref()->set_region("r");
  r.mutable_lse_ref()->set_offset(512);
  r.mutable_lse_ref()->set_byte_size(24);
  return r;
}

// A change to ByReference() and what its refusal (INVALID_ARGUMENT) says.
struct AttendCase {
  std::function<void(v1::AttendRequest*)> change;
  std::string says;
};
void ExpectRefused(const std::vector<AttendCase>& cases) {
  for (const AttendCase& c : cases) {
    FakeRegions regions(1024);
    v1::AttendRequest r = ByReference();
    c.change(&r);
    v1::AttendResponse response;
    absl::StatusOr<DecodedRequest> d = DecodeRequest(r, {}, &response, &regions);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr(c.says));
  }
}

TEST(TensorRefsTest, AttendTakesTheResolvedBytes) {
  FakeRegions regions(1024);
  v1::AttendResponse response;
  absl::StatusOr<DecodedRequest> d = DecodeRequest(ByReference(), {}, &response, &regions);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->params.q, regions.at(0));
  EXPECT_EQ(d->params.k, regions.at(128));
  EXPECT_EQ(d->params.v, regions.at(256));
  EXPECT_EQ(d->params.o, regions.at(384));
  EXPECT_EQ(reinterpret_cast<char*>(d->params.lse), regions.at(512));
  EXPECT_TRUE(response.o().data().empty());
  EXPECT_EQ(response.o().shape_size(), 4);
  EXPECT_TRUE(response.lse().data().empty());
  EXPECT_EQ(regions.asked(),
            (std::map<std::string, int64_t>{
                {"q.ref", 2}, {"k.ref", 2}, {"v.ref", 2}, {"o_ref", 2}, {"lse_ref", 4}}));
}

TEST(TensorRefsTest, SizesAreCheckedAgainstTheShapesBeforeAnythingResolves) {
  const std::vector<AttendCase> cases = {
      {[](v1::AttendRequest* r) { r->mutable_q()->mutable_ref()->set_byte_size(95); },
       "q.ref.byte_size: expected 96"},
      {[](v1::AttendRequest* r) { r->mutable_k()->set_data(std::string(80, 'x')); },
       "k.data: expected no bytes beside k.ref"},
      {[](v1::AttendRequest* r) { r->mutable_o_ref()->set_byte_size(48); },
       "o_ref.byte_size: expected 96"},
      {[](v1::AttendRequest* r) { r->set_return_lse(false); }, "lse_ref: expected only with"},
  };
  ExpectRefused(cases);
  // The resolver's own refusal comes back as it is.
  FakeRegions regions(1024);
  v1::AttendRequest r = ByReference();
  r.mutable_v()->mutable_ref()->set_region("elsewhere");
  v1::AttendResponse response;
  EXPECT_EQ(DecodeRequest(r, {}, &response, &regions).status().code(), absl::StatusCode::kNotFound);
}

TEST(TensorRefsTest, WithoutAResolverReferencesAreFailedPrecondition) {
  v1::AttendResponse response;
  absl::StatusOr<DecodedRequest> d = DecodeRequest(ByReference(), {}, &response);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("--allow_shared_memory"));
}

TEST(TensorRefsTest, StepEntriesTakeTheResolvedBytes) {
  const KvShape shape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 4};
  v1::StepEntry e;
  e.set_session_id("s");
  *e.mutable_q() = RefTensor(v1::DTYPE_FLOAT32, {4, 1, 4}, 0, 64);
  *e.mutable_k() = RefTensor(v1::DTYPE_FLOAT32, {2, 1, 4}, 64, 32);
  *e.mutable_v() = RefTensor(v1::DTYPE_FLOAT32, {2, 1, 4}, 96, 32);
  e.mutable_o_ref()->set_region("r");
  e.mutable_o_ref()->set_offset(128);
  e.mutable_o_ref()->set_byte_size(64);
  FakeRegions regions(256);
  absl::StatusOr<DecodedEntry> d = DecodeStepEntry(3, e, shape, &regions);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->q, regions.at(0));
  EXPECT_EQ(d->rows.k, regions.at(64));
  EXPECT_EQ(d->rows.v, regions.at(96));
  EXPECT_EQ(d->o, regions.at(128));
  EXPECT_EQ(regions.asked().count("entries[3].o_ref"), 1u);
  e.mutable_o_ref()->set_byte_size(32);
  EXPECT_THAT(std::string(DecodeStepEntry(3, e, shape, &regions).status().message()),
              HasSubstr("entries[3].o_ref.byte_size: expected 64"));
}

TEST(TensorRefsTest, AttendOutputsThatOverlapAnInputOrEachOtherAreRefusedNamingBoth) {
  // ByReference's spans: q [0, 96), k [128, 208), v [256, 336), o [384, 480), lse [512, 536).
  const std::vector<AttendCase> cases = {
      {[](v1::AttendRequest* r) { r->mutable_o_ref()->set_offset(0); },
       "o_ref: expected bytes apart from every input's, got bytes that overlap q's"},
      {[](v1::AttendRequest* r) { r->mutable_o_ref()->set_offset(200); },  // last 8 bytes of k
       "o_ref: expected bytes apart from every input's, got bytes that overlap k's"},
      {[](v1::AttendRequest* r) { r->mutable_lse_ref()->set_offset(332); },  // last 4 bytes of v
       "lse_ref: expected bytes apart from every input's, got bytes that overlap v's"},
      {[](v1::AttendRequest* r) { r->mutable_lse_ref()->set_offset(476); },
       "lse_ref: expected bytes apart from every other output's, got bytes that overlap o_ref's"},
      {[](v1::AttendRequest* r) { r->mutable_o_ref()->set_offset(440); },  // o now below lse
       "lse_ref: expected bytes apart from every other output's, got bytes that overlap o_ref's"},
  };
  ExpectRefused(cases);
  // Touching is not overlapping, and inputs may share bytes (k and v the same rows).
  FakeRegions regions(1024);
  v1::AttendRequest r = ByReference();
  r.mutable_o_ref()->set_offset(416);  // o [416, 512) ends where lse begins
  r.mutable_v()->mutable_ref()->set_offset(128);
  v1::AttendResponse response;
  EXPECT_TRUE(DecodeRequest(r, {}, &response, &regions).ok());
}

TEST(TensorRefsTest, StepEntriesOutputsApartFromEveryEntrysTensors) {
  // Entry i: q [4, 1, 4] float32 (64 bytes) at 256 * i, k, v [2, 1, 4] (32 bytes) at 256 * i + 64
  // and + 96, o at 256 * i + 128: apart.
  const KvShape shape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 4};
  auto entry = [](int i) {
    v1::StepEntry e;
    e.set_session_id(absl::StrCat("s", i));
    *e.mutable_q() = RefTensor(v1::DTYPE_FLOAT32, {4, 1, 4}, 256 * i, 64);
    *e.mutable_k() = RefTensor(v1::DTYPE_FLOAT32, {2, 1, 4}, 256 * i + 64, 32);
    *e.mutable_v() = RefTensor(v1::DTYPE_FLOAT32, {2, 1, 4}, 256 * i + 96, 32);
    e.mutable_o_ref()->set_region("r");
    e.mutable_o_ref()->set_offset(256 * i + 128);
    e.mutable_o_ref()->set_byte_size(64);
    return e;
  };
  struct Case {
    int entry;
    int64_t o_offset;
    std::string says;
  };
  const std::vector<Case> cases = {
      {2, 0,
       "entries[2].o_ref: expected bytes apart from every input's, got bytes that overlap "
       "entries[0].q's"},
      {0, 256 + 96 + 16,
       "entries[0].o_ref: expected bytes apart from every input's, got bytes "
       "that overlap entries[1].v's"},
      {2, 256 + 128 + 32,
       "entries[2].o_ref: expected bytes apart from every other output's, got "
       "bytes that overlap entries[1].o_ref's"},
      {1, 128 - 32,
       "entries[1].o_ref: expected bytes apart from every input's, got bytes that "
       "overlap entries[0].v's"},
  };
  for (const Case& c : cases) {
    FakeRegions regions(1024);
    std::vector<DecodedEntry> decoded;
    for (int i = 0; i < 3; ++i) {
      v1::StepEntry e = entry(i);
      if (i == c.entry) e.mutable_o_ref()->set_offset(c.o_offset);
      absl::StatusOr<DecodedEntry> d = DecodeStepEntry(i, e, shape, &regions);
      ASSERT_TRUE(d.ok()) << d.status();
      decoded.push_back(*d);
    }
    const absl::Status status = CheckEntriesApart(decoded);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.says));
  }
  FakeRegions regions(1024);
  std::vector<DecodedEntry> decoded;
  for (int i = 0; i < 3; ++i) decoded.push_back(*DecodeStepEntry(i, entry(i), shape, &regions));
  EXPECT_TRUE(CheckEntriesApart(decoded).ok());
}

TEST(TensorRefsTest, PackedStepOutputsApartFromInputsAndEachOther) {
  // Two sequences: q [2, 4, 1, 4] float32 (128 bytes) at 0, o [128 bytes] at 128, lse [2, 4, 1]
  // (32 bytes) at 256.
  const KvShape shape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 4};
  v1::StepRequest r;
  r.add_session_ids("a");
  r.add_session_ids("b");
  *r.mutable_q() = RefTensor(v1::DTYPE_FLOAT32, {2, 4, 1, 4}, 0, 128);
  r.mutable_o_ref()->set_region("r");
  r.mutable_o_ref()->set_offset(128);
  r.mutable_o_ref()->set_byte_size(128);
  r.set_return_lse(true);
  r.mutable_lse_ref()->set_region("r");
  r.mutable_lse_ref()->set_offset(256);
  r.mutable_lse_ref()->set_byte_size(32);
  FakeRegions regions(1024);
  ASSERT_TRUE(DecodePackedStep(r, shape, &regions).ok());
  r.mutable_o_ref()->set_offset(64);
  EXPECT_THAT(std::string(DecodePackedStep(r, shape, &regions).status().message()),
              HasSubstr("o_ref: expected bytes apart from every input's, got bytes that overlap "
                        "q's"));
  r.mutable_o_ref()->set_offset(128);
  r.mutable_lse_ref()->set_offset(224);
  EXPECT_THAT(std::string(DecodePackedStep(r, shape, &regions).status().message()),
              HasSubstr("lse_ref: expected bytes apart from every other output's, got bytes "
                        "that overlap o_ref's"));
}

}  // namespace
}  // namespace attention::server
