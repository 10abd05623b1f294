// A socket stream (attention.v1.Sockets.Open, a server with --socket_port): AttendStream's or
// StepStream's messages over a plain TCP connection to the server's socket port, each framed by an
// 8-byte length word instead of HTTP/2, for a client on another host whose calls are large and
// frequent (a model's layer calls; docs/API.md, "Socket streams").
//
//   attention::client::Client client({.target = "10.0.0.7:50051"});
//   auto stream = SocketStream::Open(client, v1::RING_METHOD_STEP);
//   (*stream)->Write(step_request) && (*stream)->Read(&step_response);   // as on a StepStream
//   grpc::Status status = (*stream)->Finish();
//
// The connection belongs to an Open call on the Client's channel, which carries the Client's
// token and the session owner's header and lasts as long as the socket; the connection proves it
// belongs to the call with the call's 32 random bytes. Its interface is RequestRing's
// (client/request_ring.h) and PolledStream's, so a tool can swap one for another. After an error
// (the server's end frame, or one this client finds) Write and Read return false and Finish says
// why. One thread drives it; the Client must outlive it.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/grpcpp.h"

namespace attention::client {

struct SocketStreamOptions {
  // The server's socket port; 0: ServerInfo.socket_port, asked once.
  int port = 0;
  // The host of the socket port; empty: the host of the Client's target (one host:port).
  std::string host;
  // The attention-session-owner header of the Open call (a router sends the socket to that
  // replica, client/session.h); empty: none.
  std::string owner;
};

class SocketStream {
 public:
  // Starts the Open call for `method` (RING_METHOD_ATTEND: AttendRequest in, AttendResponse out;
  // RING_METHOD_STEP: StepRequest in, StepResponse out) and connects. UNIMPLEMENTED naming
  // --socket_port when the server serves no socket streams; UNAVAILABLE when the connection
  // fails; INVALID_ARGUMENT for a target with no single host.
  static absl::StatusOr<std::unique_ptr<SocketStream>> Open(
      Client& client, v1::RingMethod method, const SocketStreamOptions& options = {});
  // Finishes, discarding the responses not read.
  ~SocketStream();
  SocketStream(const SocketStream&) = delete;
  SocketStream& operator=(const SocketStream&) = delete;

  // Sends `request`, framed. false once the stream is over or after WritesDone.
  bool Write(const google::protobuf::MessageLite& request);
  // Reads the next response (in the order the server answers: match them by request_id) into
  // `response`. false once the server's end frame came (Finish returns its status) or the
  // connection broke.
  bool Read(google::protobuf::MessageLite* response);
  // Sends no more requests (shuts this side of the connection down): the server answers those
  // sent, then ends the stream OK.
  void WritesDone();
  // WritesDone, then reads and discards responses up to the end frame; its status, or the error
  // this client found first.
  grpc::Status Finish();

 private:
  SocketStream(Client& client, v1::RingMethod method, const SocketStreamOptions& options,
               std::string nonce);
  // The next frame's bytes: true for a response; false after the end frame (its status kept) or
  // when the connection ends or fails.
  bool ReadFrame(std::string* body);
  // Reads exactly `size` bytes; false (the stream over) when the connection ends or fails.
  bool ReadExactly(char* to, size_t size);
  // Records an error (the first), after which the stream is over.
  void Break(grpc::Status error);

  const std::unique_ptr<v1::Sockets::Stub> stub_;
  const std::unique_ptr<grpc::ClientContext> context_;
  v1::OpenSocketRequest request_;
  v1::SocketClosed response_;
  std::mutex mu_;  // guards call_done_, set by the Open call's callback
  std::condition_variable call_ended_;
  bool call_done_ = false;
  int fd_ = -1;
  bool writes_done_ = false;
  bool over_ = false;    // the end frame came, or the connection broke
  grpc::Status status_;  // the end frame's, or the first error this client found
  std::string buffer_;   // a request's length word and bytes
};

}  // namespace attention::client
