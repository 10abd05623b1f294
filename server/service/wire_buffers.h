// The bytes of gRPC messages as the requests room reads them (server/requests/wire_message.h),
// and responses sent from our own buffers. Raw (ByteBuffer) methods hand us the received bytes
// as they are, so that a request which does not parse is answered INVALID_ARGUMENT by us; with
// generated (typed) methods, gRPC 1.51's callback handlers answer a failed protobuf parse with
// UNIMPLEMENTED and an empty message before any service code runs (grpcpp's
// server_callback_handlers.h: a null request makes RunHandler install an UnimplementedReactor).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/requests/wire_message.h"

namespace attention::server {

// The slices of a received message, referenced (not copied); they keep the bytes alive.
struct ReceivedBytes {
  explicit ReceivedBytes(const grpc::ByteBuffer& buffer);
  std::vector<grpc::Slice> slices;
  WireBytes wire;
};

// Parses `buffer` as `message` (INVALID_ARGUMENT naming the field and the problem).
absl::Status ParseByteBuffer(const grpc::ByteBuffer& buffer, google::protobuf::Message* message);

// Serializes `message` into `buffer` (protobuf's own encoder).
void SerializeToByteBuffer(const google::protobuf::Message& message, grpc::ByteBuffer* buffer);

// A slice over `size` bytes at `data`, which `owner` keeps alive until gRPC has sent them.
grpc::Slice SliceOver(const char* data, size_t size, std::shared_ptr<char> owner);

}  // namespace attention::server
