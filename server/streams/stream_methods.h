// The one table of stream methods that the three stream transports serve: gRPC's callback API
// (CallbackStreams), its async API polled by one thread (PolledStreams, --poll_streams), and the
// request rings in shared memory (RequestRings). A service gives each of its stream methods
// (Attention.AttendStream, Sessions.StepStream) as a StreamMethod: its window, the exchange a
// message of it needs, and its processing; main.cc puts them into one StreamMethods, and each
// transport looks a call's method up there. A method not in the table is UNIMPLEMENTED.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_context.h"

namespace attention::server {

inline constexpr char kAttendStreamPath[] = "/attention.v1.Attention/AttendStream";
inline constexpr char kStepStreamPath[] = "/attention.v1.Sessions/StepStream";

// One message of a stream: its bytes both ways (raw: the service parses the request itself,
// service/wire_buffers.h says why) and what the method keeps for it (a derived type of the
// method's own, one allocation per message).
struct StreamExchange {
  virtual ~StreamExchange() = default;
  // The parsed request's id ("" when it did not parse), naming a failed message in the stream's
  // status.
  virtual const std::string& request_id() const = 0;

  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
};

// Runs one message read from a stream, filling `exchange->response`; calls `done` exactly once,
// inline or from another thread. `exchange` (whose request it may clear once parsed) stays valid
// until then.
using StreamProcess = absl::AnyInvocable<void(StreamExchange* exchange,
                                              absl::AnyInvocable<void(absl::Status) &&> done)>;

// The streams open now, over every transport: once the drain is over, main ends them UNAVAILABLE
// (each once its answers are written), instead of leaving them to gRPC's shutdown, which cancels
// them (their clients would read CANCELLED, which clients do not retry).
class OpenStreams {
 public:
  class Stream {
   public:
    // Reads no more, and ends with `status` once the messages it holds are answered and written
    // (unless it ends otherwise first).
    virtual void End(const absl::Status& status) = 0;

   protected:
    ~Stream() = default;
  };

  void Add(const std::shared_ptr<Stream>& stream) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_[stream.get()] = stream;
  }
  void Remove(Stream* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(stream);
  }
  // Ends every stream open now with `status` (Stream::End), off the lock.
  void EndAll(const absl::Status& status) {
    std::vector<std::shared_ptr<Stream>> open;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, stream] : streams_) {
        if (std::shared_ptr<Stream> held = stream.lock()) open.push_back(std::move(held));
      }
    }
    for (const std::shared_ptr<Stream>& stream : open) stream->End(status);
  }

 private:
  std::mutex mu_;
  std::unordered_map<Stream*, std::weak_ptr<Stream>> streams_;  // guarded by mu_
};

struct StreamMethod {
  // Messages one stream may hold at once (running, or answered and waiting to be written); further
  // reads wait, so a fast sender is slowed by flow control instead of filling the queue.
  int window = 16;
  // A new message's exchange, of the method's own type.
  std::unique_ptr<StreamExchange> (*new_exchange)() = nullptr;
  // The processing of the messages of one stream of `call`.
  std::function<StreamProcess(CallContext call)> open;
  // Where its streams are while open (StreamMethods::Add sets it); null: nowhere.
  OpenStreams* open_streams = nullptr;
};

// A StreamMethod whose messages each keep a `State` (default-constructible, with request_id():
// the parsed request's, "" before), processed by `process(call, exchange, state, done)` (as a
// StreamProcess, with the stream's call and the message's state).
template <typename State, typename Process>
StreamMethod MakeStreamMethod(int window, Process process) {
  struct Exchange final : StreamExchange {
    const std::string& request_id() const override { return state.request_id(); }
    State state;
  };
  return {.window = window,
          .new_exchange = []() -> std::unique_ptr<StreamExchange> {
            return std::make_unique<Exchange>();
          },
          .open = [process](CallContext call) -> StreamProcess {
            return [process, call = std::move(call)](
                       StreamExchange* exchange, absl::AnyInvocable<void(absl::Status) &&> done) {
              process(call, exchange, &static_cast<Exchange*>(exchange)->state, std::move(done));
            };
          }};
}

class StreamMethods {
 public:
  StreamMethods() = default;
  // Its methods point at its open_streams_.
  StreamMethods(const StreamMethods&) = delete;
  StreamMethods& operator=(const StreamMethods&) = delete;

  // `path`: the method's full name, "/package.Service/Method".
  void Add(std::string path, StreamMethod method) {
    method.open_streams = &open_streams_;
    methods_.emplace_back(std::move(path), std::move(method));
  }
  // Ends every open stream of every method, over every transport, with `status` (OpenStreams).
  void EndOpenStreams(const absl::Status& status) { open_streams_.EndAll(status); }
  // The method served at `path`, or null.
  const StreamMethod* Find(absl::string_view path) const {
    for (const auto& [p, method] : methods_) {
      if (p == path) return &method;
    }
    return nullptr;
  }

 private:
  std::vector<std::pair<std::string, StreamMethod>> methods_;
  OpenStreams open_streams_;
};

}  // namespace attention::server
