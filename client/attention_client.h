// A C++ client for the attention.v1 service: unary Attend (blocking or asynchronous), a stream of
// many requests over one AttendStream call, GetServerInfo and the standard health check.
//
//   attention::client::Client client({.target = "localhost:50051"});
//   absl::StatusOr<attention::v1::AttendResponse> r = client.Attend(request);
//
// Every call carries a deadline (ClientOptions::deadline unless CallOptions overrides it) and
// returns the server's gRPC status as an absl::Status with the same code and message.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attention::client {

struct ClientOptions {
  std::string target = "localhost:50051";
  // Per-call deadline, from the moment the call starts.
  absl::Duration deadline = absl::Seconds(60);
  // Largest message sent or received; attention payloads are large (bf16 B=4, H=16, N=4096,
  // D=128 is 64 MiB per tensor).
  int max_message_bytes = 1 << 30;
  // Attend sends a request whose q, k and v together exceed this through AttendChunked, in
  // chunks of chunk_bytes (needed above 2 GiB, protobuf's ceiling, or above the server's message
  // limit); 0: always unary.
  int64_t chunked_above_bytes = int64_t{512} << 20;
  int64_t chunk_bytes = int64_t{16} << 20;
  // Channels, each its own TCP connection (a local subchannel pool), over which Attend and
  // AttendChunked calls without shared-memory references are spread round-robin, so that large
  // calls in flight at once do not share one connection's HTTP/2 flow control and one socket.
  // Everything else (sessions, regions, which belong to the connection that registered them,
  // streams, AttendAsync) uses the first. Below 1 counts as 1; ignored by the constructor that
  // takes a channel.
  int connections = 1;
  // HTTP/2 keepalive pings while calls are open, so a dead server or a dropped connection is
  // noticed during a long call; zero turns them off. gRPC servers by default answer pings more
  // frequent than every 5 minutes (when no data flows) with GOAWAY, so go lower only against a
  // server configured to permit it.
  absl::Duration keepalive_time = absl::Minutes(5);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // gRPC load-balancing policy ("round_robin", "pick_first"); empty: round_robin when `target`
  // names several addresses (see ChannelTarget), else gRPC's default (pick_first).
  std::string load_balancing;
  // Attempts per call when the server answers UNAVAILABLE (draining, or a connection lost before
  // the call reached it), through gRPC's retry service config; 1 turns retries off. gRPC retries
  // only calls whose request fits its retry buffer (see MakeChannelArguments).
  int max_attempts = 1;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // Transport security. Absent: plaintext. With it, TLS verified against `root_certs_pem` (empty:
  // the system's roots), presenting `client_cert_pem`/`client_key_pem` when set (mutual TLS).
  struct Tls {
    std::string root_certs_pem;
    std::string client_cert_pem;
    std::string client_key_pem;
  };
  std::optional<Tls> tls;
  // Sent as `authorization: Bearer <token>` on every call when not empty (servers started with
  // --auth_token_file require it). Use it with TLS: over plaintext it travels in the clear.
  std::string bearer_token;
};

// Per-call settings that override ClientOptions.
struct CallOptions {
  // Zero: ClientOptions::deadline. absl::InfiniteDuration(): none (a call that lasts as long as
  // what it carries, such as a request ring's OpenRing).
  absl::Duration deadline = absl::ZeroDuration();
};

// grpc.health.v1 serving status of a service ("" is the server as a whole).
using HealthStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

class Client {
 public:
  explicit Client(const ClientOptions& options);
  // Uses an existing channel (tests, custom credentials); options.target is ignored.
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  // One forward pass; blocks until the response or an error arrives. Requests whose tensors are
  // over options.chunked_above_bytes go through AttendChunked, unless they refer to shared memory
  // (Tensor.ref, o_ref, lse_ref).
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
                                            const CallOptions& call = {});

  // Attend through Attention.AttendChunked: q, k and v sent in chunks of `chunk_bytes` from the
  // request's own bytes (no copy: gRPC reads the slices in place), o and lse received in chunks.
  // For tensors over 2 GiB (protobuf's message ceiling) or near the message limit, and for
  // spreading one big call's bytes over HTTP/2 frames while other calls use other connections.
  absl::StatusOr<v1::AttendResponse> AttendChunked(const v1::AttendRequest& request,
                                                   int64_t chunk_bytes,
                                                   const CallOptions& call = {});

  // Starts Attend without blocking; `done` runs once, on a gRPC thread, with the result. The
  // request is copied, so the caller may drop it at once; the call's own state is gone before
  // `done` runs, so the Client may be destroyed as soon as the result is in (not from `done`).
  using AttendCallback = std::function<void(absl::StatusOr<v1::AttendResponse>)>;
  void AttendAsync(const v1::AttendRequest& request, AttendCallback done,
                   const CallOptions& call = {});
  // The same, with the result delivered through a future.
  std::future<absl::StatusOr<v1::AttendResponse>> AttendAsync(const v1::AttendRequest& request,
                                                              const CallOptions& call = {});

  // Sends every request over one AttendStream call (a writer thread, so sending never waits on
  // reading) and returns every response in the order it arrived; match them by request_id. An
  // error when the stream ends with a non-OK status or when responses are missing.
  absl::StatusOr<std::vector<v1::AttendResponse>> AttendStream(
      absl::Span<const v1::AttendRequest> requests, const CallOptions& call = {});

  absl::StatusOr<v1::ServerInfo> GetServerInfo(const CallOptions& call = {});
  // The same without waiting (gRPC's callback API): asking several servers at once
  // (client/replicas.h, Emptiest).
  std::future<absl::StatusOr<v1::ServerInfo>> GetServerInfoAsync(
      const CallOptions& call = {}) const;

  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<HealthStatus> CheckHealth(const std::string& service = "",
                                           const CallOptions& call = {});

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Every channel Attend may use: channel() first, then the other connections.
  const std::vector<std::shared_ptr<grpc::Channel>>& attend_channels() const {
    return attend_channels_;
  }
  const ClientOptions& options() const { return options_; }

  // A context whose deadline is `call`'s, or the client's default, carrying the bearer token;
  // for calls on other services over this client's channel (client/session.h).
  std::unique_ptr<grpc::ClientContext> NewContext(const CallOptions& call) const;

 private:
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
  // channel_ and options.connections - 1 more; the next Attend without references takes
  // attend_channels_[next_attend_channel_++ % size].
  std::vector<std::shared_ptr<grpc::Channel>> attend_channels_;
  std::atomic<uint64_t> next_attend_channel_{0};

  // The channel for an Attend or AttendChunked call.
  const std::shared_ptr<grpc::Channel>& AttendChannel(bool by_reference);
};

// Channel credentials for `options`: TLS (or mutual TLS) when options.tls is set, else plaintext.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& options);

// Channel arguments for `options` (message limits, keepalive, and the service config holding the
// load-balancing policy and the retry policy).
grpc::ChannelArguments MakeChannelArguments(const ClientOptions& options);

// gRPC's target for `target`: a comma-separated list of host:port ("10.0.0.1:50051,10.0.0.2:50051")
// becomes "ipv4:..." (or "ipv6:..." for bracketed hosts; "localhost" is 127.0.0.1), so one channel
// spreads calls over all of them; anything else (one address, "dns:///...", "ipv4:a,b") is
// returned unchanged.
std::string ChannelTarget(const std::string& target);

// The service config JSON for `options`: loadBalancingConfig and, when max_attempts > 1, a
// retryPolicy for UNAVAILABLE on every method of attention.v1.Attention and grpc.health.v1.Health.
// Empty when neither applies.
std::string ServiceConfigJson(const ClientOptions& options);

// `request` encoded as an AttendRequest message whose tensor bytes are slices over the request's
// own data (no copy): `request` must outlive the call that sends it.
grpc::ByteBuffer EncodeInPlace(const v1::AttendRequest& request);

// A grpc::Status as an absl::Status: same code, same message.
absl::Status ToAbslStatus(const grpc::Status& status);

}  // namespace attention::client
