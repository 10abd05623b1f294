// Parsing of attention.v1 messages straight from the bytes gRPC received (the slices of a
// grpc::ByteBuffer), so that tensor bytes are never copied by protobuf and every undecodable
// request gets INVALID_ARGUMENT naming the field and what is wrong with it.
//
// The walk: each field's tag and length are read here, in place over the slices, and checked
// against the message's descriptor (a known field must come with its type's wire type, a
// length-delimited field must end inside its message, a varint is at most 10 bytes, a string is
// UTF-8; nested messages are walked the same way). A Tensor's `data` (AttendRequest q, k, v) is
// kept as a byte range over the slices (WireRange) and copied once, later, straight to where the
// backend reads it (CopyTo). Every other field's bytes go to protobuf as they are, so fields added
// to the messages later parse without any change here. Unknown fields (a newer client) are kept,
// as protobuf keeps them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/message.h"

namespace attention::server {

// A byte sequence in pieces (for gRPC, the slices of one received message), read in place.
class WireBytes {
 public:
  explicit WireBytes(std::vector<absl::string_view> pieces);
  int64_t size() const { return size_; }
  // The byte at `pos` (< size()).
  uint8_t At(int64_t pos) const;
  // The rest of the piece that holds `pos` (< size()), from `pos` on.
  absl::string_view PieceFrom(int64_t pos) const;
  // Copies [begin, begin + length) to `dst`, piece by piece (by 4 threads above 8 MiB).
  // Thread-safe (the piece cache below is not used).
  void CopyTo(int64_t begin, int64_t length, char* dst) const;
  std::string Substr(int64_t begin, int64_t length) const;

 private:
  // The piece holding `pos`; remembers the last one found (the walk reads mostly forward).
  int PieceOf(int64_t pos) const;
  void CopySerial(int64_t begin, int64_t length, char* dst) const;

  std::vector<absl::string_view> pieces_;
  std::vector<int64_t> starts_;  // starts_[i]: offset of pieces_[i]
  int64_t size_ = 0;
  mutable int last_ = 0;
};

// Where a tensor's data lies in the WireBytes it was parsed from.
struct WireRange {
  int64_t begin = 0;
  int64_t size = 0;
};

// An AttendRequest as parsed from the wire: every field but the tensors' data in `header`
// (q, k, v present with dtype and shape, their data empty), the data as ranges of the wire bytes.
struct WireAttendRequest {
  v1::AttendRequest header;
  WireRange q, k, v;  // size 0 when the tensor, or its data, is absent
};

// Parses `wire` as an AttendRequest (INVALID_ARGUMENT naming the field and the problem).
absl::Status ParseAttendRequest(const WireBytes& wire, WireAttendRequest* request);

// One message of an AttendChunked call: `header` holds every field but a chunk's data, which
// lies at `data` in the wire bytes (size 0 for the request message, or an empty chunk).
struct WireAttendChunk {
  v1::AttendChunk header;
  WireRange data;
};
absl::Status ParseAttendChunk(const WireBytes& wire, WireAttendChunk* chunk);

// A bytes field kept as a range: its path of field numbers from the top message ({2, 3}: q.data
// of an AttendRequest), through singular message fields.
struct RangedField {
  std::vector<int> path;
};
// Parses `wire` as `message` (INVALID_ARGUMENT naming the field and the problem), except the
// fields `ranged` names: those stay empty in `message`, and ranges[i] says where ranged[i]'s
// bytes lie (size 0 when absent). Every other field goes to protobuf as it came.
absl::Status ParseWithRanges(const WireBytes& wire, google::protobuf::Message* message,
                             absl::Span<const RangedField> ranged, std::vector<WireRange>* ranges);

// Parses `wire` as `message`, any message of attention.v1 (INVALID_ARGUMENT naming the field and
// the problem). Here protobuf copies every byte, tensors included (the Sessions messages). A
// StepRequest (one per layer per token) is parsed by protobuf alone first, and walked only when
// protobuf refuses it (to name the problem) or it holds unknown fields (a known field of the wrong
// wire type among them is refused).
absl::Status ParseMessage(const WireBytes& wire, google::protobuf::Message* message);

// The encoding of a message field whose bytes field the caller sends as a separate piece: the tag
// of `field_number` in the outer message and its length, `fields` (the submessage without its
// data: a Tensor's dtype and shape, a TensorChunk's tensor and offset), and the tag and length of
// its field `data_field_number`; `data_bytes` of data follow on the wire. Appends to `out`.
void AppendSubmessagePrefix(int field_number, const google::protobuf::Message& fields,
                            int data_field_number, int64_t data_bytes, std::string* out);

}  // namespace attention::server
