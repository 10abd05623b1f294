#include "client/attention_client.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/field_mask.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/field_mask_util.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace attention::client {

grpc::ChannelArguments MakeChannelArguments(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.keepalive_time > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_timeout)));
  }
  const std::string service_config = ServiceConfigJson(options);
  if (!service_config.empty()) args.SetServiceConfigJSON(service_config);
  if (options.max_attempts > 1) {
    // gRPC keeps a call's sent messages for a retry only up to this size (256 KiB by default,
    // smaller than most attention requests); the request is kept alive by the call anyway.
    args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, options.max_message_bytes);
  }
  return args;
}

std::string ChannelTarget(const std::string& target) {
  if (target.find(',') == std::string::npos || target.find(':') == std::string::npos) return target;
  // A target that already names its resolver is gRPC's to parse.
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:", "unix:"}) {
    if (absl::StartsWith(target, scheme)) return target;
  }
  std::vector<std::string> addresses = absl::StrSplit(target, ',', absl::SkipWhitespace());
  bool ipv6 = false;
  for (std::string& address : addresses) {
    address.erase(std::remove(address.begin(), address.end(), ' '), address.end());
    if (absl::StartsWith(address, "localhost:")) {
      address = absl::StrCat("127.0.0.1", address.substr(9));
    }
    ipv6 = ipv6 || absl::StartsWith(address, "[");
  }
  return absl::StrCat(ipv6 ? "ipv6:" : "ipv4:", absl::StrJoin(addresses, ","));
}

std::string ServiceConfigJson(const ClientOptions& options) {
  std::string policy = options.load_balancing;
  if (policy.empty() && ChannelTarget(options.target).find(',') != std::string::npos) {
    policy = "round_robin";
  }
  std::vector<std::string> parts;
  if (!policy.empty()) {
    parts.push_back(absl::StrCat(R"("loadBalancingConfig":[{")", policy, R"(":{}}])"));
  }
  if (options.max_attempts > 1) {
    parts.push_back(
        absl::StrCat(R"("methodConfig":[{"name":[{"service":"attention.v1.Attention"},)",
                     R"({"service":"grpc.health.v1.Health"}],"retryPolicy":{"maxAttempts":)",
                     options.max_attempts, R"(,"initialBackoff":")",
                     absl::ToDoubleSeconds(options.initial_backoff), R"(s","maxBackoff":")",
                     absl::ToDoubleSeconds(options.max_backoff),
                     R"(s","backoffMultiplier":2,"retryableStatusCodes":["UNAVAILABLE"]}}])"));
  }
  if (parts.empty()) return "";
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& options) {
  if (!options.tls) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls->root_certs_pem;
  ssl.pem_cert_chain = options.tls->client_cert_pem;
  ssl.pem_private_key = options.tls->client_key_pem;
  return grpc::SslCredentials(ssl);
}

Client::Client(const ClientOptions& options)
    : Client(grpc::CreateCustomChannel(ChannelTarget(options.target), ChannelCredentials(options),
                                       MakeChannelArguments(options)),
             options) {
  for (int i = 1; i < options.connections; ++i) {
    // A channel of its own subchannel pool opens its own connection; channels of equal
    // arguments would otherwise share one.
    grpc::ChannelArguments args = MakeChannelArguments(options);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    attend_channels_.push_back(grpc::CreateCustomChannel(ChannelTarget(options.target),
                                                         ChannelCredentials(options), args));
  }
}

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)),
      attend_channels_{channel_} {}

const std::shared_ptr<grpc::Channel>& Client::AttendChannel(bool by_reference) {
  if (by_reference || attend_channels_.size() == 1) return channel_;
  return attend_channels_[next_attend_channel_.fetch_add(1, std::memory_order_relaxed) %
                          attend_channels_.size()];
}

std::unique_ptr<grpc::ClientContext> Client::NewContext(const CallOptions& call) const {
  auto context = std::make_unique<grpc::ClientContext>();
  const absl::Duration deadline =
      call.deadline > absl::ZeroDuration() ? call.deadline : options_.deadline;
  if (deadline != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  }
  // Metadata rather than call credentials, which gRPC sends only over TLS: a plaintext channel on
  // loopback or inside a mesh may carry the token too.
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
  return context;
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& request,
                                                  const CallOptions& call) {
  const int64_t tensor_bytes = static_cast<int64_t>(
      request.q().data().size() + request.k().data().size() + request.v().data().size());
  // Tensors by reference and outputs into a region go through Attend (chunks carry bytes).
  const bool by_reference = request.q().has_ref() || request.k().has_ref() ||
                            request.v().has_ref() || request.has_o_ref() || request.has_lse_ref();
  if (options_.chunked_above_bytes > 0 && tensor_bytes > options_.chunked_above_bytes &&
      !by_reference) {
    return AttendChunked(request, options_.chunk_bytes, call);
  }
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  // Sent from the request's own bytes (EncodeInPlace): no serialization copy of the tensors.
  grpc::ByteBuffer out = EncodeInPlace(request);
  // A blocking call over the async API on a queue of its own: this thread polls the connection
  // while it waits, so the response reaches it with no hop between threads (on the callback API
  // the completion ran on one of gRPC's threads, which then woke this one).
  grpc::CompletionQueue cq;
  grpc::GenericStub stub(AttendChannel(by_reference));
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader =
      stub.PrepareUnaryCall(context.get(), "/attention.v1.Attention/Attend", out, &cq);
  reader->StartCall();
  grpc::ByteBuffer in;
  grpc::Status status;
  reader->Finish(&in, &status, /*tag=*/nullptr);
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    return absl::InternalError("Attend: the call's completion queue ended without its answer");
  }
  if (!status.ok()) return ToAbslStatus(status);
  v1::AttendResponse response;
  if (!grpc::SerializationTraits<v1::AttendResponse>::Deserialize(&in, &response).ok()) {
    return absl::InternalError("Attend: the response does not parse");
  }
  return response;
}

namespace {

// The request's fields but the tensors' data (shapes, dtypes, options, fields added later too).
v1::AttendRequest WithoutData(const v1::AttendRequest& request) {
  google::protobuf::FieldMask mask;
  const google::protobuf::Descriptor* type = v1::AttendRequest::descriptor();
  for (int i = 0; i < type->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = type->field(i);
    if (field->message_type() == v1::Tensor::descriptor()) {
      // Only a tensor the request has: a mask path would create an absent one.
      if (!request.GetReflection()->HasField(request, field)) continue;
      // Every field of the tensor but its data (dtype, shape, a ref into shared memory, ...);
      // again only the submessages it has.
      const google::protobuf::Message& tensor = request.GetReflection()->GetMessage(request, field);
      const google::protobuf::Descriptor* tensor_type = v1::Tensor::descriptor();
      for (int j = 0; j < tensor_type->field_count(); ++j) {
        const google::protobuf::FieldDescriptor* part = tensor_type->field(j);
        if (part->number() == v1::Tensor::kDataFieldNumber) continue;
        if (part->message_type() != nullptr && !part->is_repeated() &&
            !tensor.GetReflection()->HasField(tensor, part)) {
          continue;
        }
        mask.add_paths(field->name() + "." + part->name());
      }
    } else {
      mask.add_paths(field->name());
    }
  }
  v1::AttendRequest header;
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(request, mask, {}, &header);
  return header;
}

// `size` bytes at `data`, referenced in place (the caller keeps them alive during the call).
grpc::Slice InPlace(const char* data, size_t size) {
  return grpc::Slice(data, size, grpc::Slice::STATIC_SLICE);
}

// The tag and length of a length-delimited field `field_number` of `length` bytes.
std::string LengthPrefix(int field_number, uint64_t length) {
  using google::protobuf::internal::WireFormatLite;
  std::string prefix;
  {
    google::protobuf::io::StringOutputStream out(&prefix);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.WriteTag(
        WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint64(length);
  }  // the stream's destructor trims `prefix` to what was written
  return prefix;
}

// An AttendChunk holding one chunk whose `size` data bytes at `data` the message references
// in place: the encoded fields, then a slice over the caller's bytes.
grpc::ByteBuffer ChunkMessage(v1::ChunkTensor tensor, int64_t offset, const char* data,
                              int64_t size) {
  v1::TensorChunk fields;
  fields.set_tensor(tensor);
  fields.set_offset(offset);
  const std::string encoded = fields.SerializeAsString();
  const uint64_t chunk_size =
      encoded.size() + LengthPrefix(v1::TensorChunk::kDataFieldNumber, size).size() + size;
  const std::string prefix = LengthPrefix(v1::AttendChunk::kChunkFieldNumber, chunk_size) +
                             encoded + LengthPrefix(v1::TensorChunk::kDataFieldNumber, size);
  grpc::Slice slices[2] = {grpc::Slice(prefix), InPlace(data, static_cast<size_t>(size))};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace

grpc::ByteBuffer EncodeInPlace(const v1::AttendRequest& request) {
  // The fields but the tensors' data, then each tensor's data field as a prefix and a slice over
  // the request's bytes: a message protobuf parses as `request` (field order is free).
  std::vector<grpc::Slice> slices;
  slices.emplace_back(WithoutData(request).SerializeAsString());
  for (const auto& [number, t] : {std::pair{v1::AttendRequest::kQFieldNumber, &request.q()},
                                  {v1::AttendRequest::kKFieldNumber, &request.k()},
                                  {v1::AttendRequest::kVFieldNumber, &request.v()}}) {
    if (t->data().empty()) continue;
    const std::string data_prefix = LengthPrefix(v1::Tensor::kDataFieldNumber, t->data().size());
    slices.emplace_back(LengthPrefix(number, data_prefix.size() + t->data().size()) + data_prefix);
    slices.push_back(InPlace(t->data().data(), t->data().size()));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::StatusOr<v1::AttendResponse> Client::AttendChunked(const v1::AttendRequest& request,
                                                         int64_t chunk_bytes,
                                                         const CallOptions& call) {
  if (chunk_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: expected > 0, got ", chunk_bytes));
  }
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  grpc::CompletionQueue cq;
  // AttendChunked refuses references, so any channel serves it.
  grpc::GenericStub stub(AttendChannel(/*by_reference=*/false));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw =
      stub.PrepareCall(context.get(), "/attention.v1.Attention/AttendChunked", &cq);
  // One operation at a time, each awaited: a blocking call over the async API (the generic
  // stub's, which takes our slices as they are).
  auto await = [&cq] {
    void* tag = nullptr;
    bool ok = false;
    return cq.Next(&tag, &ok) && ok;
  };
  auto finish = [&]() -> absl::Status {
    grpc::Status status;
    rw->Finish(&status, nullptr);
    await();
    return ToAbslStatus(status);
  };
  rw->StartCall(nullptr);
  bool ok = await();
  if (ok) {
    v1::AttendChunk head;
    *head.mutable_request() = WithoutData(request);
    grpc::ByteBuffer message;
    bool own = false;
    ok = grpc::SerializationTraits<v1::AttendChunk>::Serialize(head, &message, &own).ok();
    if (ok) rw->Write(message, nullptr);
    ok = ok && await();
  }
  for (const auto& [tensor, t] : {std::pair{v1::CHUNK_TENSOR_Q, &request.q()},
                                  {v1::CHUNK_TENSOR_K, &request.k()},
                                  {v1::CHUNK_TENSOR_V, &request.v()}}) {
    const int64_t size = static_cast<int64_t>(t->data().size());
    for (int64_t at = 0; ok && at < size; at += chunk_bytes) {
      rw->Write(ChunkMessage(tensor, at, t->data().data() + at, std::min(chunk_bytes, size - at)),
                nullptr);
      ok = await();
    }
  }
  if (ok) {
    rw->WritesDone(nullptr);
    ok = await();
  }
  // The answer: the response, then chunks of o and lse. (After a failed write the status says
  // why; reading first drains what the server sent.)
  v1::AttendResponse response;
  bool have_response = false;
  int64_t received[2] = {0, 0};  // o, lse
  absl::Status problem;
  for (;;) {
    grpc::ByteBuffer message;
    rw->Read(&message, nullptr);
    if (!await()) break;
    v1::AttendChunk part;
    if (!grpc::SerializationTraits<v1::AttendChunk>::Deserialize(&message, &part).ok()) {
      problem = absl::InternalError("AttendChunked: a response message does not parse");
      break;
    }
    if (part.has_response()) {
      response = std::move(*part.mutable_response());
      have_response = true;
      // o like q; lse float32 of its shape.
      response.mutable_o()->mutable_data()->resize(request.q().data().size());
      if (response.has_lse()) {
        int64_t elements = 1;
        for (int64_t d : response.lse().shape()) elements *= d;
        response.mutable_lse()->mutable_data()->resize(elements * sizeof(float));
      }
      continue;
    }
    const v1::TensorChunk& chunk = part.chunk();
    const bool is_o = chunk.tensor() == v1::CHUNK_TENSOR_O;
    std::string* data =
        is_o ? response.mutable_o()->mutable_data() : response.mutable_lse()->mutable_data();
    if (!have_response || (!is_o && chunk.tensor() != v1::CHUNK_TENSOR_LSE) || chunk.offset() < 0 ||
        chunk.offset() + static_cast<int64_t>(chunk.data().size()) >
            static_cast<int64_t>(data->size())) {
      problem = absl::InternalError("AttendChunked: a response chunk outside its tensor");
      break;
    }
    std::memcpy(data->data() + chunk.offset(), chunk.data().data(), chunk.data().size());
    received[is_o ? 0 : 1] += static_cast<int64_t>(chunk.data().size());
  }
  if (!problem.ok()) {
    context->TryCancel();
    finish().IgnoreError();
    return problem;
  }
  if (absl::Status status = finish(); !status.ok()) return status;
  if (!have_response || received[0] != static_cast<int64_t>(response.o().data().size()) ||
      received[1] != static_cast<int64_t>(response.lse().data().size())) {
    return absl::InternalError(absl::StrCat(
        "AttendChunked: the answer ended with o ", received[0], " of ", response.o().data().size(),
        " and lse ", received[1], " of ", response.lse().data().size(), " bytes"));
  }
  return response;
}

namespace {

// Starts a unary call on gRPC's callback API: start(context, &request, &response, on_done) is the
// stub's async method. The callback API needs context, request and response alive until the call
// completes; they live in one heap object that the completion callback frees before it calls
// `done`: the context holds a reference to the channel, and were it released after `done` let the
// caller drop its Client, the channel's last reference would go on gRPC's callback thread, where
// gRPC 1.51 then shuts its library down under that thread (a crash).
template <typename Request, typename Response, typename Start>
void UnaryAsync(std::unique_ptr<grpc::ClientContext> context, Request request, Start start,
                std::function<void(absl::StatusOr<Response>)> done) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    Request request;
    Response response;
    std::function<void(absl::StatusOr<Response>)> done;
  };
  auto* state = new Call{std::move(context), std::move(request), {}, std::move(done)};
  start(state->context.get(), &state->request, &state->response, [state](grpc::Status status) {
    std::unique_ptr<Call> owned(state);
    std::function<void(absl::StatusOr<Response>)> done = std::move(owned->done);
    absl::StatusOr<Response> result =
        status.ok() ? absl::StatusOr<Response>(std::move(owned->response)) : ToAbslStatus(status);
    owned.reset();
    done(std::move(result));
  });
}

// A callback that sets `*future`'s value.
template <typename T>
std::function<void(T)> Fulfil(std::future<T>* future) {
  auto promise = std::make_shared<std::promise<T>>();
  *future = promise->get_future();
  return [promise](T value) { promise->set_value(std::move(value)); };
}

}  // namespace

void Client::AttendAsync(const v1::AttendRequest& request, AttendCallback done,
                         const CallOptions& call) {
  UnaryAsync<v1::AttendRequest, v1::AttendResponse>(
      NewContext(call), request,
      [this](auto... args) { stub_->async()->Attend(std::move(args)...); }, std::move(done));
}

std::future<absl::StatusOr<v1::AttendResponse>> Client::AttendAsync(
    const v1::AttendRequest& request, const CallOptions& call) {
  std::future<absl::StatusOr<v1::AttendResponse>> future;
  AttendAsync(request, Fulfil(&future), call);
  return future;
}

absl::StatusOr<std::vector<v1::AttendResponse>> Client::AttendStream(
    absl::Span<const v1::AttendRequest> requests, const CallOptions& call) {
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> stream =
      stub_->AttendStream(context.get());
  // The server may stop reading until its replies are read, so writing happens on its own
  // thread while this one reads.
  std::thread writer([&] {
    for (const v1::AttendRequest& request : requests) {
      if (!stream->Write(request)) break;  // the stream is over; Finish says why
    }
    stream->WritesDone();
  });
  std::vector<v1::AttendResponse> responses;
  responses.reserve(requests.size());
  v1::AttendResponse response;
  while (stream->Read(&response)) responses.push_back(std::move(response));
  writer.join();
  grpc::Status status = stream->Finish();
  if (!status.ok()) return ToAbslStatus(status);
  if (responses.size() != requests.size()) {
    return absl::DataLossError(absl::StrCat("AttendStream sent ", requests.size(),
                                            " requests and got ", responses.size(), " responses"));
  }
  return responses;
}

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo(const CallOptions& call) {
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  v1::ServerInfo info;
  grpc::Status status = stub_->GetServerInfo(context.get(), v1::GetServerInfoRequest(), &info);
  if (!status.ok()) return ToAbslStatus(status);
  return info;
}

std::future<absl::StatusOr<v1::ServerInfo>> Client::GetServerInfoAsync(
    const CallOptions& call) const {
  std::future<absl::StatusOr<v1::ServerInfo>> future;
  UnaryAsync<v1::GetServerInfoRequest, v1::ServerInfo>(
      NewContext(call), v1::GetServerInfoRequest(),
      [this](auto... args) { stub_->async()->GetServerInfo(std::move(args)...); }, Fulfil(&future));
  return future;
}

absl::StatusOr<HealthStatus> Client::CheckHealth(const std::string& service,
                                                 const CallOptions& call) {
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health_stub_->Check(context.get(), request, &response);
  if (!status.ok()) return ToAbslStatus(status);
  return response.status();
}

}  // namespace attention::client
