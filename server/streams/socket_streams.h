// Socket streams (attention.v1.Sockets.Open, --socket_port): AttendStream's or StepStream's
// messages over a plain TCP connection, each framed by an 8-byte length word instead of HTTP/2.
// Why: a remote model's layer call is one large message each way, and on the GPU host a bare gRPC
// echo of a batch-64 Step's bytes (768 KiB up, 512 KiB back) takes 0.70 ms from C++ and 1.10 ms
// from grpcio against 0.14 ms for the same bytes over a raw loopback socket
// (bench/results/2026-12-06-tcp-malloc-h100.md): HTTP/2's framing, flow control and thread hops,
// paid on every layer of every token.
//
// A socket belongs to a gRPC call: the client sends 32 random bytes in Sockets.Open, connects to
// the socket port and sends "ATTNSOCK" and the same bytes. The call gives the socket's requests
// everything a gRPC stream's messages have (the token, the owner of sessions and regions, the
// deadline, cancellation), and the server answers the call when the socket ends, as OpenRing's
// rings (request_rings.h). Until then each request is a message of its stream method, processed
// on the socket's thread as the other transports do (StreamFlow, stream_reactor.h: the window, the
// queue order, the first failure ending the stream).
//
// Frames, little-endian: a request or a response is its length (u64) and the serialized message;
// the server's last frame is the end frame, a length with bit 63 set over the status code (u32)
// and its message, after which it closes the connection. The client ends its requests by shutting
// its side down at a frame boundary.
//
// Hostile clients: a connection that does not complete its hello, or whose nonce no call brings,
// within the hello timeout is closed (a connection may come before its call, which the client
// sends first but which may arrive second; at most kMaxHellos wait at once, more are closed at
// once); an Open whose connection does not come within the hello timeout ends DEADLINE_EXCEEDED;
// a request longer than the server's largest message ends the stream RESOURCE_EXHAUSTED before
// its bytes are read; request bytes are held only as they arrive; an answer the client does not
// read for the stall timeout ends the stream DEADLINE_EXCEEDED; at most max_sockets are served
// (or wait for their connection) at once, each served on a thread of its own.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_gate.h"
#include "server/calls/service_threads.h"
#include "server/streams/stream_methods.h"

namespace attention::server {

struct SocketStreamOptions {
  int max_sockets = 16;  // sockets served or waiting for their connection at once
  absl::Duration stall_timeout = absl::Seconds(30);
  int64_t max_message_bytes = int64_t{1024} << 20;  // a request's length at most
  absl::Duration hello_timeout = absl::Seconds(10);
};

class SocketStreams final : public v1::Sockets::CallbackService {
 public:
  // "ATTNSOCK", then the Open call's nonce.
  static constexpr char kHelloMagic[] = "ATTNSOCK";
  static constexpr int kNonceBytes = 32;
  // Connections accepted whose hello is not complete, or whose call has not come, at most: more
  // are closed at once.
  static constexpr int kMaxHellos = 64;

  // `methods` and `gate` must outlive this.
  SocketStreams(const StreamMethods* methods, const CallGate* gate, SocketStreamOptions options);
  // Stops, if Stop has not.
  ~SocketStreams() override;
  SocketStreams(const SocketStreams&) = delete;
  SocketStreams& operator=(const SocketStreams&) = delete;

  // Listens on `host`:`port` (0 picks a free one) and starts accepting; the port.
  absl::StatusOr<int> Listen(const std::string& host, int port);

  grpc::ServerUnaryReactor* Open(grpc::CallbackServerContext* context,
                                 const v1::OpenSocketRequest* request,
                                 v1::SocketClosed* response) override;

  // Once the server has shut down (so every socket's call is cancelled) and the scheduler with it
  // (so nothing is in flight): stops accepting, answers the calls still waiting for their
  // connection, joins the sockets' threads.
  void Stop();

 private:
  class Call;
  class Flow;
  struct Pending;

  // The acceptor's thread: new connections, their hellos, the pending calls' timeouts.
  void Accept();
  // The connection `fd` whose hello brought `nonce`: its pending call's socket starts (true);
  // false when no call waits with that nonce (yet). Once stopped, fd is closed (true).
  bool Bind(int fd, const std::string& nonce);
  // Answers the pending calls that were cancelled or waited past the hello timeout (`all`: every
  // one, UNAVAILABLE). Needs mu_.
  void ExpirePendingLocked(absl::Time now, bool all);
  // Wakes the acceptor's thread.
  void WakeAcceptor();

  const StreamMethods* const methods_;
  const CallGate* const gate_;
  const SocketStreamOptions options_;
  Metrics* const metrics_;  // the gate's
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd the acceptor polls beside the listener
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::map<std::string, Pending> pending_;  // guarded by mu_: calls by nonce, waiting
  ServiceThreads servers_;                  // guarded by mu_: a thread for each socket
  std::atomic<int> serving_{0};             // sockets not yet closed (attention_socket_streams)
  bool stopped_ = false;                    // guarded by mu_
};

}  // namespace attention::server
