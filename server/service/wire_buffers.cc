#include "server/service/wire_buffers.h"

#include <utility>

#include "absl/strings/string_view.h"

namespace attention::server {
namespace {

std::vector<grpc::Slice> Slices(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  // Dump references the buffer's slices; it fails only on a buffer gRPC never filled (empty).
  if (buffer.Valid() && !buffer.Dump(&slices).ok()) slices.clear();
  return slices;
}

std::vector<absl::string_view> Views(const std::vector<grpc::Slice>& slices) {
  std::vector<absl::string_view> views;
  views.reserve(slices.size());
  for (const grpc::Slice& s : slices) {
    views.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return views;
}

}  // namespace

ReceivedBytes::ReceivedBytes(const grpc::ByteBuffer& buffer)
    : slices(Slices(buffer)), wire(Views(slices)) {}

absl::Status ParseByteBuffer(const grpc::ByteBuffer& buffer, google::protobuf::Message* message) {
  const ReceivedBytes bytes(buffer);
  return ParseMessage(bytes.wire, message);
}

void SerializeToByteBuffer(const google::protobuf::Message& message, grpc::ByteBuffer* buffer) {
  bool own_buffer = false;
  grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, buffer, &own_buffer)
      .IgnoreError();  // fails only for a message over 2 GiB, which the limits exclude
}

grpc::Slice SliceOver(const char* data, size_t size, std::shared_ptr<char> owner) {
  auto* keep = new std::shared_ptr<char>(std::move(owner));
  return grpc::Slice(
      const_cast<char*>(data), size,
      [](void* user_data) { delete static_cast<std::shared_ptr<char>*>(user_data); }, keep);
}

}  // namespace attention::server
