// The wire parser against protobuf's own encoding: requests split at every kind of slice boundary
// parse to the same fields and tensor bytes, and each kind of undecodable bytes is refused with
// INVALID_ARGUMENT naming the field and the problem.
#include "server/requests/wire_message.h"

#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using v1::AttendRequest;

std::string RandomBytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

AttendRequest SampleRequest(std::mt19937& rng) {
  AttendRequest r;
  r.set_request_id("req-7 \xc3\xa9");  // UTF-8 beyond ASCII
  for (auto [t, rows] : {std::pair{r.mutable_q(), 3}, {r.mutable_k(), 5}, {r.mutable_v(), 5}}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int d : {1, 2, rows, 4}) t->add_shape(d);
    *t->mutable_data() = RandomBytes(rng, 2 * rows * 4 * 4);
  }
  r.set_layout(v1::LAYOUT_BSHD);
  r.set_causal(true);
  r.set_softmax_scale(0.25f);
  r.set_window_left(7);
  r.set_return_lse(true);
  return r;
}

// `bytes` cut into pieces of the given sizes (the last takes the rest).
WireBytes Split(const std::string& bytes, std::mt19937& rng, int max_piece) {
  std::vector<absl::string_view> pieces;
  std::uniform_int_distribution<int> size(1, max_piece);
  for (size_t pos = 0; pos < bytes.size();) {
    const size_t n = std::min<size_t>(size(rng), bytes.size() - pos);
    pieces.emplace_back(bytes.data() + pos, n);
    pos += n;
  }
  return WireBytes(std::move(pieces));
}

std::string Data(const WireBytes& wire, const WireRange& range) {
  std::string out(range.size, '\0');
  wire.CopyTo(range.begin, range.size, out.data());
  return out;
}

TEST(WireMessageTest, ParsesWhatProtobufEncodedOverAnySlicing) {
  std::mt19937 rng(11);
  AttendRequest request = SampleRequest(rng);
  // A field this parser does not know (a newer client's) travels as an unknown field.
  request.GetReflection()->MutableUnknownFields(&request)->AddVarint(99, 5);
  const std::string bytes = request.SerializeAsString();
  for (int max_piece : {1, 2, 7, 64, 1 << 20}) {
    SCOPED_TRACE(max_piece);
    const WireBytes wire = Split(bytes, rng, max_piece);
    WireAttendRequest parsed;
    ASSERT_TRUE(ParseAttendRequest(wire, &parsed).ok());
    EXPECT_EQ(Data(wire, parsed.q), request.q().data());
    EXPECT_EQ(Data(wire, parsed.k), request.k().data());
    EXPECT_EQ(Data(wire, parsed.v), request.v().data());
    AttendRequest expected = request;
    for (v1::Tensor* t : {expected.mutable_q(), expected.mutable_k(), expected.mutable_v()}) {
      t->clear_data();
    }
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed.header, expected))
        << parsed.header.DebugString();
  }
}

TEST(WireMessageTest, CopiesLargeRangesOverManyPieces) {
  std::mt19937 rng(5);
  const std::string bytes = RandomBytes(rng, (size_t{9} << 20) + 13);  // over the 4-thread split
  const WireBytes wire = Split(bytes, rng, 70000);
  std::string out(bytes.size() - 10, '\0');
  wire.CopyTo(3, static_cast<int64_t>(out.size()), out.data());
  const std::string expected = bytes.substr(3, out.size());
  size_t first_diff = 0;
  while (first_diff < out.size() && out[first_diff] == expected[first_diff]) ++first_diff;
  EXPECT_EQ(first_diff, out.size()) << "the copy differs from byte " << first_diff;
}

// Each kind of undecodable bytes, with what the message must name.
struct Bad {
  const char* name;
  std::string bytes;
  std::vector<const char*> says;
};

std::vector<Bad> BadRequests() {
  std::mt19937 rng(3);
  const std::string good = SampleRequest(rng).SerializeAsString();
  std::vector<Bad> bad;
  bad.push_back({"truncated", good.substr(0, good.size() - 3), {"truncated"}});
  // q (field 2) as a varint.
  bad.push_back({"wrong wire type", std::string("\x10\x05", 2), {"q", "wire type"}});
  // request_id's length as an 11-byte varint.
  bad.push_back({"overlong varint",
                 std::string("\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),
                 {"request_id", "overlong varint"}});
  bad.push_back({"invalid utf-8", std::string("\x0a\x02\xc3\x28", 4), {"request_id", "UTF-8"}});
  bad.push_back({"field number 0", std::string("\x02\x00", 2), {"field number 0"}});
  bad.push_back({"group", std::string("\x1b\x1c", 2), {"wire type 3"}});
  bad.push_back({"wire type 7", std::string("\x0f\x00", 2), {"wire type 7"}});
  // q.shape packed, its last varint cut.
  bad.push_back({"nested truncated", std::string("\x12\x04\x12\x02\x01\x80", 6), {"q.shape"}});
  // k.data longer than k.
  bad.push_back({"nested length", std::string("\x1a\x03\x1a\x09\x00", 5), {"k.data", "length"}});
  return bad;
}

TEST(WireMessageTest, UndecodableBytesAreInvalidArgumentNamingTheProblem) {
  for (const Bad& b : BadRequests()) {
    SCOPED_TRACE(b.name);
    WireAttendRequest parsed;
    const absl::Status status = ParseAttendRequest(WireBytes({b.bytes}), &parsed);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    for (const char* word : b.says) EXPECT_THAT(status.message(), HasSubstr(word));
    // The generic parse (the Sessions messages' path) walks the same way.
    AttendRequest whole;
    const absl::Status generic = ParseMessage(WireBytes({b.bytes}), &whole);
    EXPECT_EQ(generic.code(), absl::StatusCode::kInvalidArgument);
    for (const char* word : b.says) EXPECT_THAT(generic.message(), HasSubstr(word));
  }
}

TEST(WireMessageTest, EveryCutOfARequestParsesOrIsInvalidArgument) {
  std::mt19937 rng(8);
  const std::string good = SampleRequest(rng).SerializeAsString();
  for (size_t n = 0; n <= good.size(); ++n) {
    WireAttendRequest parsed;
    const absl::Status status = ParseAttendRequest(WireBytes({good.substr(0, n)}), &parsed);
    AttendRequest reference;
    // Protobuf and this parser agree on which prefixes are whole messages.
    EXPECT_EQ(status.ok(), reference.ParseFromString(good.substr(0, n))) << n << ": " << status;
    if (!status.ok()) EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(WireMessageTest, RandomBytesNeverCrash) {
  std::mt19937 rng(21);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string bytes = RandomBytes(rng, rng() % 64);
    WireAttendRequest parsed;
    const absl::Status status = ParseAttendRequest(WireBytes({bytes}), &parsed);
    if (!status.ok()) {
      ++refused;
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    }
  }
  EXPECT_GT(refused, 1000);
}

TEST(WireMessageTest, ParseMessageNamesNestedFields) {
  v1::StepRequest step;
  step.add_entries()->set_session_id("a");
  std::string bytes = step.SerializeAsString();
  // entries[0].session_id: invalid UTF-8.
  bytes[bytes.size() - 1] = '\xff';
  const absl::Status status = ParseMessage(WireBytes({bytes}), &step);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("entries.session_id"));
}

// Inside an entry, an unknown field number passes (kept as protobuf keeps it) and a known field of
// the wrong wire type, which protobuf would keep as an unknown one, is refused naming it.
TEST(WireMessageTest, UnknownFieldsAreWalked) {
  v1::StepRequest step;
  step.add_entries()->set_session_id("a");
  const std::string entry_fields = step.entries(0).SerializeAsString();
  auto with_entry_tail = [&](const std::string& tail) {
    const std::string entry = entry_fields + tail;
    return std::string("\x12") + static_cast<char>(entry.size()) + entry;
  };
  v1::StepRequest parsed;
  ASSERT_EQ(ParseMessage(WireBytes({with_entry_tail("")}), &parsed), absl::OkStatus());
  EXPECT_EQ(parsed.entries(0).session_id(), "a");
  // Field 99 as a varint: unknown, kept.
  ASSERT_EQ(ParseMessage(WireBytes({with_entry_tail(std::string("\x98\x06\x07", 3))}), &parsed),
            absl::OkStatus());
  EXPECT_EQ(parsed.entries(0).session_id(), "a");
  EXPECT_EQ(parsed.entries(0).GetReflection()->GetUnknownFields(parsed.entries(0)).field_count(),
            1);
  // q (field 2 of StepEntry, a message) as a varint.
  const absl::Status status =
      ParseMessage(WireBytes({with_entry_tail(std::string("\x10\x05", 2))}), &parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("entries.q"));
  EXPECT_THAT(status.message(), HasSubstr("wire type"));
}

// A Step parses by protobuf alone when it holds no unknown field; one deep inside (a q's ref) sends
// it through the walk, which keeps an unknown number and refuses a known one of the wrong wire type
// by name. A string that is not UTF-8 is named by the walk, not logged by protobuf.
TEST(WireMessageTest, StepsWithUnknownFieldsDeepInsideAreWalked) {
  v1::StepRequest step;
  v1::StepEntry* entry = step.add_entries();
  entry->set_session_id("a");
  entry->mutable_q()->mutable_ref()->set_region("r");
  const std::string ref_fields = entry->q().ref().SerializeAsString();
  // entries[0] = {session_id "a", q = {ref = ref_fields + tail}}.
  auto with_ref_tail = [&](const std::string& tail) {
    const std::string ref = ref_fields + tail;
    const std::string q = std::string("\x22") + static_cast<char>(ref.size()) + ref;
    const std::string e = std::string("\x0a\x01") + "a" + "\x12" + static_cast<char>(q.size()) + q;
    return std::string("\x12") + static_cast<char>(e.size()) + e;
  };
  v1::StepRequest parsed;
  ASSERT_EQ(ParseMessage(WireBytes({with_ref_tail("")}), &parsed), absl::OkStatus());
  EXPECT_EQ(parsed.entries(0).q().ref().region(), "r");
  // Field 99 as a varint inside q.ref: unknown, kept.
  ASSERT_EQ(ParseMessage(WireBytes({with_ref_tail(std::string("\x98\x06\x07", 3))}), &parsed),
            absl::OkStatus());
  const v1::TensorRef& ref = parsed.entries(0).q().ref();
  EXPECT_EQ(ref.GetReflection()->GetUnknownFields(ref).field_count(), 1);
  // offset (field 2 of TensorRef, a varint) as a length-delimited field.
  const absl::Status status =
      ParseMessage(WireBytes({with_ref_tail(std::string("\x12\x01\x00", 3))}), &parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("entries.q.ref.offset"));
  EXPECT_THAT(status.message(), HasSubstr("wire type"));

  std::string bad = step.SerializeAsString();
  bad[bad.size() - 1] = '\xff';  // the region's one character
  testing::internal::CaptureStderr();
  const absl::Status utf8 = ParseMessage(WireBytes({bad}), &parsed);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(utf8.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(utf8.message(), HasSubstr("entries.q.ref.region"));
}

// The Step's fast path looks for unknown fields in the messages a Step holds as wire_message.cc's
// HasUnknownFields descends into them; a message field added to any of them must be added there.
TEST(WireMessageTest, StepFastPathKnowsEveryNestedMessage) {
  std::set<std::string> nested;
  std::vector<const google::protobuf::Descriptor*> todo = {v1::StepRequest::descriptor()};
  while (!todo.empty()) {
    const google::protobuf::Descriptor* d = todo.back();
    todo.pop_back();
    for (int i = 0; i < d->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* f = d->field(i);
      if (f->message_type() == nullptr) continue;
      if (nested.insert(f->full_name()).second) todo.push_back(f->message_type());
    }
  }
  EXPECT_EQ(
      nested,
      (std::set<std::string>{
          "attention.v1.StepRequest.entries", "attention.v1.StepEntry.q",
          "attention.v1.StepEntry.k", "attention.v1.StepEntry.v", "attention.v1.StepEntry.o_ref",
          "attention.v1.Tensor.ref", "attention.v1.StepRequest.q", "attention.v1.StepRequest.k",
          "attention.v1.StepRequest.v", "attention.v1.StepRequest.o_ref",
          "attention.v1.StepRequest.lse_ref", "attention.v1.StepRequest.ready_counter",
          "attention.v1.StepRequest.done_counter", "attention.v1.StreamCounter.ref"}));
}

// A string split between two pieces of the wire is checked as one: a character cut in two is
// valid UTF-8, a bad byte after the cut is not, and the error names the nested field.
TEST(WireMessageTest, StringsOverTwoPiecesAreCheckedWhole) {
  for (const auto& [id, valid] :
       {std::pair{std::string("ab\xc3\xa9"), true}, std::pair{std::string("ab\xc3\x28"), false}}) {
    SCOPED_TRACE(valid);
    v1::StepRequest step;
    step.add_entries()->set_session_id(id);
    const std::string bytes = step.SerializeAsString();
    // The cut falls between the last two bytes (the two of the session id's last character).
    const size_t cut = bytes.size() - 1;
    v1::StepRequest parsed;
    const absl::Status status = ParseMessage(
        WireBytes({absl::string_view(bytes).substr(0, cut), absl::string_view(bytes).substr(cut)}),
        &parsed);
    if (valid) {
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(parsed.entries(0).session_id(), id);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(status.message(), HasSubstr("entries.session_id"));
      EXPECT_THAT(status.message(), HasSubstr("UTF-8"));
    }
  }
}

TEST(WireMessageTest, TensorPrefixAndDataParseAsTheTensor) {
  std::mt19937 rng(2);
  v1::Tensor header;
  header.set_dtype(v1::DTYPE_BFLOAT16);
  for (int d : {2, 3, 300}) header.add_shape(d);
  const std::string data = RandomBytes(rng, 2 * 3 * 300 * 2);
  v1::AttendResponse head;
  head.set_request_id("r");
  std::string bytes = head.SerializeAsString();
  AppendSubmessagePrefix(v1::AttendResponse::kOFieldNumber, header, v1::Tensor::kDataFieldNumber,
                         data.size(), &bytes);
  bytes += data;
  v1::AttendResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.request_id(), "r");
  EXPECT_EQ(parsed.o().dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_THAT(parsed.o().shape(), ::testing::ElementsAre(2, 3, 300));
  EXPECT_TRUE(parsed.o().data() == data);
}

}  // namespace
}  // namespace attention::server
