#include "server/requests/wire_message.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/status_macros.h"

namespace attention::server {

WireBytes::WireBytes(std::vector<absl::string_view> pieces) {
  for (absl::string_view piece : pieces) {
    if (piece.empty()) continue;
    starts_.push_back(size_);
    pieces_.push_back(piece);
    size_ += static_cast<int64_t>(piece.size());
  }
}

int WireBytes::PieceOf(int64_t pos) const {
  const int n = static_cast<int>(pieces_.size());
  if (last_ < n && pos >= starts_[last_] &&
      pos < starts_[last_] + static_cast<int64_t>(pieces_[last_].size())) {
    return last_;
  }
  last_ =
      static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
  return last_;
}

absl::string_view WireBytes::PieceFrom(int64_t pos) const {
  const int i = PieceOf(pos);
  return pieces_[i].substr(pos - starts_[i]);
}

uint8_t WireBytes::At(int64_t pos) const {
  const int i = PieceOf(pos);
  return static_cast<uint8_t>(pieces_[i][pos - starts_[i]]);
}

void WireBytes::CopySerial(int64_t begin, int64_t length, char* dst) const {
  if (length == 0) return;
  const int first = static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), begin) -
                                     starts_.begin() - 1);
  for (int i = first; length > 0; ++i) {
    const int64_t offset = begin - starts_[i];
    const int64_t n = std::min<int64_t>(length, static_cast<int64_t>(pieces_[i].size()) - offset);
    std::memcpy(dst, pieces_[i].data() + offset, n);
    dst += n;
    begin += n;
    length -= n;
  }
}

void WireBytes::CopyTo(int64_t begin, int64_t length, char* dst) const {
  // One thread copies at 5-6 GB/s (measured on the H200 host), below the socket's rate and far
  // below the 55 GB/s DMA that follows for a GPU: large ranges are copied by 4 threads.
  constexpr int64_t kSplitAbove = int64_t{8} << 20;
  constexpr int kThreads = 4;
  if (length < kSplitAbove) return CopySerial(begin, length, dst);
  // Rounded up: the 4 parts cover every byte.
  const int64_t part = ((length + kThreads - 1) / kThreads + 63) / 64 * 64;
  auto copy = [&](int t) {
    const int64_t from = std::min(length, t * part), to = std::min(length, from + part);
    CopySerial(begin + from, to - from, dst + from);
  };
  std::thread helpers[kThreads - 1];
  for (int t = 1; t < kThreads; ++t) helpers[t - 1] = std::thread(copy, t);
  copy(0);
  for (std::thread& h : helpers) h.join();
}

std::string WireBytes::Substr(int64_t begin, int64_t length) const {
  std::string out(length, '\0');
  CopyTo(begin, length, out.data());
  return out;
}

namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

enum WireType : int {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5
};

std::string WireTypeString(int wire_type) {
  static constexpr const char* kNames[] = {"varint",      "64-bit",    "length-delimited",
                                           "start-group", "end-group", "32-bit"};
  if (wire_type < 0 || wire_type > 5) return absl::StrCat(wire_type, " (invalid)");
  return absl::StrCat(wire_type, " (", kNames[wire_type], ")");
}

// The wire type a field of this type is written with (not packed).
int WireTypeOf(const FieldDescriptor* field) {
  switch (field->type()) {
    case FieldDescriptor::TYPE_DOUBLE:
    case FieldDescriptor::TYPE_FIXED64:
    case FieldDescriptor::TYPE_SFIXED64:
      return kFixed64;
    case FieldDescriptor::TYPE_FLOAT:
    case FieldDescriptor::TYPE_FIXED32:
    case FieldDescriptor::TYPE_SFIXED32:
      return kFixed32;
    case FieldDescriptor::TYPE_STRING:
    case FieldDescriptor::TYPE_BYTES:
    case FieldDescriptor::TYPE_MESSAGE:
      return kLengthDelimited;
    case FieldDescriptor::TYPE_GROUP:
      return kStartGroup;
    default:
      return kVarint;  // the integer types, bool, enum
  }
}

// One field as it lies on the wire.
struct WireField {
  int number = 0;
  int wire_type = 0;
  int64_t begin = 0;        // the tag's first byte
  int64_t value_begin = 0;  // the value (for length-delimited: after the length)
  int64_t end = 0;          // one past the value
};

// Where a problem lies, named only when there is one: building the dotted name of every field
// read ("entries.q.ref.region") cost more than the rest of the walk on a Step of 8 entries by
// reference (~200 fields). `number` 0 is the top (named `top`, "" for the request itself); else a
// field of the message at `parent`.
struct Place {
  const Place* parent = nullptr;
  absl::string_view top;
  const FieldDescriptor* field = nullptr;
  int number = 0;

  std::string Name() const {
    if (number == 0) return std::string(top);
    const std::string own = field != nullptr ? field->name() : absl::StrCat("field ", number);
    const std::string outer = parent->Name();
    return outer.empty() ? own : absl::StrCat(outer, ".", own);
  }
};

// Reads the fields of one message in place, checking the wire structure.
class Walker {
 public:
  explicit Walker(const WireBytes& wire) : wire_(wire) {}

  // Checks the fields of [begin, end) as message `type` named `path` (nested messages of known
  // fields too) and calls `on_field` for each field of this level.
  absl::Status Walk(
      int64_t begin, int64_t end, const Descriptor* type, absl::string_view path,
      absl::FunctionRef<absl::Status(const WireField&, const FieldDescriptor*)> on_field) const {
    return Walk(begin, end, type, Place{.top = path}, on_field);
  }

  // Checks every level of [begin, end) as `type`.
  absl::Status Check(int64_t begin, int64_t end, const Descriptor* type,
                     absl::string_view path) const {
    return Check(begin, end, type, Place{.top = path});
  }

  static absl::Status Error(absl::string_view name, absl::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat(name.empty() ? "request" : name, ": undecodable bytes: ", problem));
  }
  static absl::Status Error(const Place& place, absl::string_view problem) {
    return Error(place.Name(), problem);
  }

  static std::string FieldName(absl::string_view path, const FieldDescriptor* field, int number) {
    const Place top{.top = path};
    return Place{.parent = &top, .field = field, .number = number}.Name();
  }

 private:
  // Reads a varint at *pos (< end) into *value and moves *pos past it.
  absl::Status Varint(int64_t* pos, int64_t end, const Place& place, absl::string_view what,
                      uint64_t* value) const {
    if (ABSL_PREDICT_TRUE(WholeVarint(pos, end, value))) return absl::OkStatus();
    return VarintByBytes(pos, end, place, what, value);
  }

  // The common case, inline: a varint whole inside the piece that holds its first byte (a Step
  // of 8 entries by reference has ~500 varints; reading each byte through WireBytes::At cost more
  // than the rest of the walk). False, with *pos unmoved, for anything else (a piece boundary,
  // the message's end, an overlong varint): VarintByBytes reads those and names the problem.
  bool WholeVarint(int64_t* pos, int64_t end, uint64_t* value) const {
    if (*pos >= end) return false;
    const uint8_t* bytes = nullptr;
    const int64_t n = std::min<int64_t>({Window(*pos, &bytes), end - *pos, 9});
    uint64_t result = 0;
    for (int64_t i = 0; i < n; ++i) {
      result |= static_cast<uint64_t>(bytes[i] & 0x7f) << (7 * i);
      if ((bytes[i] & 0x80) == 0) {
        *pos += i + 1;
        *value = result;
        return true;
      }
    }
    return false;
  }

  ABSL_ATTRIBUTE_NOINLINE absl::Status VarintByBytes(int64_t* pos, int64_t end, const Place& place,
                                                     absl::string_view what,
                                                     uint64_t* value) const {
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      if (*pos >= end) {
        return Error(place, absl::StrCat(what, " is truncated at byte ", *pos,
                                         " (a varint runs past the end of the message)"));
      }
      const uint8_t byte = wire_.At((*pos)++);
      if (i == 9 && byte > 1) break;  // a 10th byte holds only bit 63
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        *value = result;
        return absl::OkStatus();
      }
    }
    return Error(place, absl::StrCat(what, " at byte ", *pos,
                                     " is an overlong varint (over 10 bytes or 64 bits)"));
  }

  absl::Status Walk(
      int64_t begin, int64_t end, const Descriptor* type, const Place& at,
      absl::FunctionRef<absl::Status(const WireField&, const FieldDescriptor*)> on_field) const {
    int64_t pos = begin;
    while (pos < end) {
      WireField f;
      f.begin = pos;
      uint64_t tag = 0;
      RETURN_IF_ERROR(Varint(&pos, end, at, "a field's tag", &tag));
      f.number = static_cast<int>(std::min<uint64_t>(tag >> 3, uint64_t{1} << 30));
      f.wire_type = static_cast<int>(tag & 7);
      if (f.number == 0 || f.number > FieldDescriptor::kMaxNumber) {
        return Error(at,
                     absl::StrCat("field number ", tag >> 3, " at byte ", f.begin,
                                  " is invalid (expected 1..", FieldDescriptor::kMaxNumber, ")"));
      }
      const FieldDescriptor* field = type->FindFieldByNumber(f.number);
      const Place here{.parent = &at, .field = field, .number = f.number};
      if (f.wire_type == kStartGroup || f.wire_type == kEndGroup || f.wire_type > kFixed32) {
        return Error(here, absl::StrCat("wire type ", WireTypeString(f.wire_type),
                                        " is not used by attention.v1"));
      }
      if (field != nullptr) {
        const int expected = WireTypeOf(field);
        const bool packed = field->is_packable() && f.wire_type == kLengthDelimited;
        if (f.wire_type != expected && !packed) {
          return Error(here, absl::StrCat("expected wire type ", WireTypeString(expected),
                                          field->is_packable() ? " or 2 (packed)" : "", ", got ",
                                          WireTypeString(f.wire_type)));
        }
      }
      uint64_t value = 0;
      switch (f.wire_type) {
        case kVarint:
          f.value_begin = pos;
          RETURN_IF_ERROR(Varint(&pos, end, here, "the value", &value));
          break;
        case kFixed64:
        case kFixed32: {
          const int64_t size = f.wire_type == kFixed64 ? 8 : 4;
          f.value_begin = pos;
          if (end - pos < size) {
            return Error(here, absl::StrCat("truncated: a ", size, "-byte value at byte ", pos,
                                            ", ", end - pos, " bytes left"));
          }
          pos += size;
          break;
        }
        case kLengthDelimited: {
          RETURN_IF_ERROR(Varint(&pos, end, here, "the length", &value));
          if (value > static_cast<uint64_t>(end - pos)) {
            return Error(here, absl::StrCat("truncated: length ", value, " at byte ", pos,
                                            " runs past the end of its message (", end - pos,
                                            " bytes left)"));
          }
          f.value_begin = pos;
          pos += static_cast<int64_t>(value);
          break;
        }
      }
      f.end = pos;
      if (field != nullptr) RETURN_IF_ERROR(CheckValue(f, field, here));
      RETURN_IF_ERROR(on_field(f, field));
    }
    return absl::OkStatus();
  }

  absl::Status Check(int64_t begin, int64_t end, const Descriptor* type, const Place& at) const {
    return Walk(begin, end, type, at,
                [](const WireField&, const FieldDescriptor*) { return absl::OkStatus(); });
  }

  // Checks the value of known field `field`: strings are UTF-8, messages are walked, packed
  // repeated scalars hold whole values.
  absl::Status CheckValue(const WireField& f, const FieldDescriptor* field,
                          const Place& here) const {
    if (f.wire_type != kLengthDelimited) return absl::OkStatus();
    const int64_t size = f.end - f.value_begin;
    switch (field->type()) {
      case FieldDescriptor::TYPE_STRING: {
        // In place when the string lies in one piece of the wire (nearly always), else a copy.
        absl::string_view text = wire_.PieceFrom(f.value_begin);
        std::string joined;
        if (static_cast<int64_t>(text.size()) >= size) {
          text = text.substr(0, size);
        } else {
          joined = wire_.Substr(f.value_begin, size);
          text = joined;
        }
        if (!google::protobuf::internal::IsStructurallyValidUTF8(text.data(),
                                                                 static_cast<int>(text.size()))) {
          return Error(here, "expected a UTF-8 string, got bytes that are not valid UTF-8");
        }
        return absl::OkStatus();
      }
      case FieldDescriptor::TYPE_BYTES:
        return absl::OkStatus();
      case FieldDescriptor::TYPE_MESSAGE:
        return Check(f.value_begin, f.end, field->message_type(), here);
      default:
        break;  // packed scalars
    }
    const int element = WireTypeOf(field);
    if (element == kFixed32 || element == kFixed64) {
      const int64_t width = element == kFixed32 ? 4 : 8;
      if (size % width != 0) {
        return Error(here, absl::StrCat("packed ", width, "-byte values in ", size,
                                        " bytes (not a multiple of ", width, ")"));
      }
      return absl::OkStatus();
    }
    for (int64_t pos = f.value_begin; pos < f.end;) {
      uint64_t value = 0;
      RETURN_IF_ERROR(Varint(&pos, f.end, here, "a packed value", &value));
    }
    return absl::OkStatus();
  }

  // Points *bytes at the byte at `pos` (< the wire's size) and returns how many bytes of its
  // piece follow from there. The piece last used is kept: the walk reads mostly forward.
  int64_t Window(int64_t pos, const uint8_t** bytes) const {
    if (pos < window_begin_ || pos >= window_end_) {
      const absl::string_view piece = wire_.PieceFrom(pos);
      window_begin_ = pos;
      window_end_ = pos + static_cast<int64_t>(piece.size());
      window_ = reinterpret_cast<const uint8_t*>(piece.data());
    }
    *bytes = window_ + (pos - window_begin_);
    return window_end_ - pos;
  }

  const WireBytes& wire_;
  mutable int64_t window_begin_ = 0, window_end_ = 0;  // Window's piece: [begin, end) of the wire
  mutable const uint8_t* window_ = nullptr;            // its byte at window_begin_
};

// The pieces of a WireBytes as a protobuf input stream (protobuf parses them without joining).
class WireInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  WireInputStream(const WireBytes& wire, int64_t size) : wire_(wire), size_(size) {}
  bool Next(const void** data, int* size) override {
    if (pos_ >= size_) return false;
    // Hand out at most 1 GiB at a time (an int), within one piece.
    const absl::string_view rest = wire_.PieceFrom(pos_);
    const int64_t n = std::min<int64_t>(
        std::min<int64_t>(static_cast<int64_t>(rest.size()), size_ - pos_), int64_t{1} << 30);
    *data = rest.data();
    *size = static_cast<int>(n);
    pos_ += n;
    return true;
  }
  void BackUp(int count) override { pos_ -= count; }
  bool Skip(int count) override {
    if (count > size_ - pos_) {
      pos_ = size_;
      return false;
    }
    pos_ += count;
    return true;
  }
  int64_t ByteCount() const override { return pos_; }

 private:
  const WireBytes& wire_;
  const int64_t size_;
  int64_t pos_ = 0;
};

// Whether a parsed Step holds an unknown field at any level: where protobuf met a field number it
// does not know, or a known one of the wrong wire type (which the walk refuses). Descends by the
// generated accessors, each type's reflection looked up once: reflection's generic descent over
// the 41 messages of a Step of 8 entries by reference cost ~3.5 us on the development machine, as
// much as the walk it saves.
template <typename M>
bool HasOwnUnknownFields(const M& m) {
  static const google::protobuf::Reflection* const reflection = M::GetReflection();
  return !reflection->GetUnknownFields(m).empty();
}
bool HasUnknownFields(const v1::Tensor& tensor) {
  return HasOwnUnknownFields(tensor) || (tensor.has_ref() && HasOwnUnknownFields(tensor.ref()));
}
bool HasUnknownFields(const v1::StreamCounter& counter) {
  return HasOwnUnknownFields(counter) || (counter.has_ref() && HasOwnUnknownFields(counter.ref()));
}
bool HasUnknownFields(const v1::StepRequest& step) {
  if (HasOwnUnknownFields(step) || (step.has_q() && HasUnknownFields(step.q())) ||
      (step.has_k() && HasUnknownFields(step.k())) ||
      (step.has_v() && HasUnknownFields(step.v())) ||
      (step.has_o_ref() && HasOwnUnknownFields(step.o_ref())) ||
      (step.has_lse_ref() && HasOwnUnknownFields(step.lse_ref())) ||
      (step.has_ready_counter() && HasUnknownFields(step.ready_counter())) ||
      (step.has_done_counter() && HasUnknownFields(step.done_counter()))) {
    return true;
  }
  for (const v1::StepEntry& entry : step.entries()) {
    if (HasOwnUnknownFields(entry) || (entry.has_q() && HasUnknownFields(entry.q())) ||
        (entry.has_k() && HasUnknownFields(entry.k())) ||
        (entry.has_v() && HasUnknownFields(entry.v())) ||
        (entry.has_o_ref() && HasOwnUnknownFields(entry.o_ref()))) {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status ParseWithRanges(const WireBytes& wire, google::protobuf::Message* message,
                             absl::Span<const RangedField> ranged, std::vector<WireRange>* ranges) {
  ranges->assign(ranged.size(), WireRange{});
  const Walker walker(wire);
  // Walks [begin, end) as `m`, at `depth` of the paths in `active` (those whose first `depth`
  // numbers led here): a field ending one is recorded, one leading further is descended into;
  // every other field's bytes go to protobuf as they came.
  std::function<absl::Status(int64_t, int64_t, google::protobuf::Message*, int,
                             const std::vector<size_t>&, absl::string_view)>
      walk = [&](int64_t begin, int64_t end, google::protobuf::Message* m, int depth,
                 const std::vector<size_t>& active, absl::string_view path) -> absl::Status {
    std::string plain;
    RETURN_IF_ERROR(walker.Walk(
        begin, end, m->GetDescriptor(), path,
        [&](const WireField& f, const FieldDescriptor* field) -> absl::Status {
          std::vector<size_t> further;
          for (size_t i : active) {
            const std::vector<int>& p = ranged[i].path;
            if (field == nullptr || p[depth] != f.number) continue;
            if (static_cast<int>(p.size()) == depth + 1) {
              (*ranges)[i] = WireRange{.begin = f.value_begin, .size = f.end - f.value_begin};
              return absl::OkStatus();
            }
            if (field->type() == FieldDescriptor::TYPE_MESSAGE && !field->is_repeated()) {
              further.push_back(i);
            }
          }
          if (further.empty()) {
            plain += wire.Substr(f.begin, f.end - f.begin);
            return absl::OkStatus();
          }
          return walk(f.value_begin, f.end, m->GetReflection()->MutableMessage(m, field), depth + 1,
                      further, Walker::FieldName(path, field, f.number));
        }));
    if (!m->MergeFromString(plain)) {
      return Walker::Error(path, "protobuf cannot parse its fields");
    }
    return absl::OkStatus();
  };
  std::vector<size_t> all(ranged.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return walk(0, wire.size(), message, 0, all, "");
}

absl::Status ParseAttendRequest(const WireBytes& wire, WireAttendRequest* request) {
  static const std::vector<RangedField>* const kTensorData = new std::vector<RangedField>{
      {{v1::AttendRequest::kQFieldNumber, v1::Tensor::kDataFieldNumber}},
      {{v1::AttendRequest::kKFieldNumber, v1::Tensor::kDataFieldNumber}},
      {{v1::AttendRequest::kVFieldNumber, v1::Tensor::kDataFieldNumber}}};
  std::vector<WireRange> ranges;
  RETURN_IF_ERROR(ParseWithRanges(wire, &request->header, *kTensorData, &ranges));
  request->q = ranges[0];
  request->k = ranges[1];
  request->v = ranges[2];
  return absl::OkStatus();
}

absl::Status ParseAttendChunk(const WireBytes& wire, WireAttendChunk* chunk) {
  static const std::vector<RangedField>* const kChunkData = new std::vector<RangedField>{
      {{v1::AttendChunk::kChunkFieldNumber, v1::TensorChunk::kDataFieldNumber}}};
  std::vector<WireRange> ranges;
  RETURN_IF_ERROR(ParseWithRanges(wire, &chunk->header, *kChunkData, &ranges));
  chunk->data = ranges[0];
  return absl::OkStatus();
}

absl::Status ParseMessage(const WireBytes& wire, google::protobuf::Message* message) {
  // A decode Step, the one message a model sends per layer per token, goes to protobuf alone
  // first. Where protobuf parses the whole message and finds no unknown field, the walk would pass
  // it too: protobuf fails on truncation, bad lengths, varints over 10 bytes, invalid UTF-8 and
  // wire types 6-7, and keeps groups and known fields of the wrong wire type as unknown fields.
  // So the walk runs only to name the problem, or to check a Step's unknown fields (which then
  // needs no second parse). request_parse_bench (bench/README.md) times the three cases. One
  // leniency is protobuf's: a 10th varint byte may carry bits past bit 63, which it drops. The
  // silencer keeps protobuf from logging each string that is not UTF-8 (the walk's error names
  // it).
  const bool step = message->GetDescriptor() == v1::StepRequest::descriptor();
  bool parsed = false;
  if (step) {
    {
      const google::protobuf::LogSilencer quiet;
      WireInputStream stream(wire, wire.size());
      parsed = message->ParseFromZeroCopyStream(&stream);
    }
    if (parsed && !HasUnknownFields(*static_cast<const v1::StepRequest*>(message))) {
      return absl::OkStatus();
    }
  }
  RETURN_IF_ERROR(Walker(wire).Check(0, wire.size(), message->GetDescriptor(), ""));
  if (!step) {
    WireInputStream stream(wire, wire.size());
    parsed = message->ParseFromZeroCopyStream(&stream);
  }
  if (!parsed) return Walker::Error("", "protobuf cannot parse it");
  return absl::OkStatus();
}

void AppendSubmessagePrefix(int field_number, const google::protobuf::Message& fields_message,
                            int data_field_number, int64_t data_bytes, std::string* out) {
  auto varint = [out](uint64_t value) {
    while (value >= 0x80) {
      out->push_back(static_cast<char>(value | 0x80));
      value >>= 7;
    }
    out->push_back(static_cast<char>(value));
  };
  const std::string fields = fields_message.SerializeAsString();
  // The data field's tag and length, then (outside `out`) its bytes.
  std::string data_prefix;
  std::swap(*out, data_prefix);
  varint(static_cast<uint64_t>(data_field_number) << 3 | kLengthDelimited);
  varint(static_cast<uint64_t>(data_bytes));
  std::swap(*out, data_prefix);
  varint(static_cast<uint64_t>(field_number) << 3 | kLengthDelimited);
  varint(fields.size() + data_prefix.size() + static_cast<uint64_t>(data_bytes));
  *out += fields;
  *out += data_prefix;
}

}  // namespace attention::server
