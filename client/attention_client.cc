#include "client/attention_client.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

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
  return args;
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

Client::Client(const ClientOptions& options)
    : Client(grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(),
                                       MakeChannelArguments(options)),
             options) {}

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

std::unique_ptr<grpc::ClientContext> Client::NewContext(const CallOptions& call) const {
  auto context = std::make_unique<grpc::ClientContext>();
  const absl::Duration deadline =
      call.deadline > absl::ZeroDuration() ? call.deadline : options_.deadline;
  context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return context;
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& request,
                                                  const CallOptions& call) {
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  v1::AttendResponse response;
  grpc::Status status = stub_->Attend(context.get(), request, &response);
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

void Client::AttendAsync(const v1::AttendRequest& request, AttendCallback done,
                         const CallOptions& call) {
  // The callback API needs context, request and response alive until the call completes; they
  // live in one heap object that the completion callback frees.
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    v1::AttendRequest request;
    v1::AttendResponse response;
    AttendCallback done;
  };
  auto* state = new Call{NewContext(call), request, {}, std::move(done)};
  stub_->async()->Attend(state->context.get(), &state->request, &state->response,
                         [state](grpc::Status status) {
                           std::unique_ptr<Call> owned(state);
                           if (status.ok()) {
                             owned->done(std::move(owned->response));
                           } else {
                             owned->done(ToAbslStatus(status));
                           }
                         });
}

std::future<absl::StatusOr<v1::AttendResponse>> Client::AttendAsync(
    const v1::AttendRequest& request, const CallOptions& call) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<v1::AttendResponse>>>();
  std::future<absl::StatusOr<v1::AttendResponse>> future = promise->get_future();
  AttendAsync(
      request,
      [promise](absl::StatusOr<v1::AttendResponse> result) {
        promise->set_value(std::move(result));
      },
      call);
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
