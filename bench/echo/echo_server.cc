// attn_echo_server: serves attention.bench.Echo (echo.proto) with the same message limits as the
// attention server, so attn_bench --echo measures the transport alone. On gRPC's callback API (as
// the attention server) or, with --sync, its synchronous API (a thread per stream that reads and
// writes itself), and on TCP and, with --unix_socket, a Unix domain socket too: the transport
// variants a co-located client can choose between (bench/colo/latency.sh compares them).
//
//   attn_echo_server --port=50061            # or --port=0 --port_file=/tmp/echo.port
//   attn_echo_server --port=0 --unix_socket=/tmp/echo.sock --sync
//
// --reply_delay_us=T (callback API, EchoStream): each reply is written T us after its request was
// read, by another thread that holds (spinning) meanwhile, as the attention server's worker does
// while a decode kernel runs: the transport around a job of T us, with the same one thread hop
// and the same idle gRPC threads, and no GPU. --read_ahead starts each next read as soon as a
// request is read, before its reply (as the attention server's streams do, so a client may
// pipeline; replies then queue behind the one being written), instead of once the reply is
// written.
// --poll: EchoStream on gRPC's async API instead, its completion queue drained by one thread that
// polls it without ever sleeping (unary Echo stays on the callback API), with --reply_delay_us
// and --read_ahead as above: whether a server thread that never sleeps takes the wake-ups out of
// the transport around a job (the design a polling StepStream would have; one core busy always).
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/echo/echo.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(int, port, 50061, "Port; 0 picks a free one.");
ABSL_FLAG(std::string, port_file, "", "When set, the chosen port is written here once listening.");
ABSL_FLAG(int, max_message_mb, 1024, "Largest message received or sent, MiB.");
ABSL_FLAG(std::string, unix_socket, "",
          "When set, also listen on this Unix domain socket path (clients: unix:PATH).");
ABSL_FLAG(bool, sync, false, "Serve on gRPC's synchronous API instead of its callback API.");
ABSL_FLAG(int, reply_delay_us, 0,
          "Callback API, EchoStream: write each reply this long after its request was read, from "
          "a thread that spins meanwhile (a stand-in for a job run by a worker).");

ABSL_FLAG(bool, read_ahead, false,
          "EchoStream: start the next read as soon as a request is read, before its reply is "
          "written, as the attention server does.");
ABSL_FLAG(bool, poll, false,
          "EchoStream on gRPC's async API, its completion queue polled by one thread that never "
          "sleeps (keeps one core busy); unary Echo stays on the callback API.");

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One thread that runs each reply `delay` after it was queued, spinning until then (the attention
// server's worker spins in cudaEventSynchronize while its kernel runs).
class DelayedReplies {
 public:
  explicit DelayedReplies(std::chrono::microseconds delay)
      : delay_(delay), thread_([this] { Loop(); }) {}
  ~DelayedReplies() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }
  void Queue(std::function<void()> reply) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(Clock::now() + delay_, std::move(reply));
    }
    wake_.notify_one();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto [at, reply] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      while (Clock::now() < at) {
      }
      reply();
      lock.lock();
    }
  }

  const std::chrono::microseconds delay_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::pair<Clock::time_point, std::function<void()>>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the rest is constructed
};

// The bookkeeping of one EchoStream, the same on the callback and the async API: its replies in
// order, one write at a time (gRPC takes no second write before the first completes, and with
// read-ahead the client's next request can arrive before that completion does), and Finish once
// nothing is left to read, write or wait for (after Finish the stream goes: no completion and no
// delayed reply may still point at it). Every member needs the stream's lock.
struct ReplyFlow {
  enum class Next { kNothing, kWrite, kFinish };

  // A read completed: true when it brought a request (whose reply the stream then makes).
  bool ReadDone(bool ok) {
    reading = false;
    if (ok && !broken) return true;
    reads_done = true;  // the client half-closed, or the call broke
    return false;
  }
  void Ready(EchoReply reply) {
    if (!broken) ready.push_back(std::move(reply));
  }
  // The front reply's write completed; true when the stream should read next (without
  // read-ahead, a read starts once the reply is out).
  bool Written(bool ok, bool read_ahead) {
    writing = false;
    ready.pop_front();
    if (!ok) {
      broken = true;  // nothing more can be written
      ready.clear();
    }
    return ok && !read_ahead && !reads_done;
  }
  // What the stream starts now: the write of ready.front(), or Finish with FinishStatus().
  Next Pump() {
    if (finishing) return Next::kNothing;
    if (!writing && !ready.empty()) {
      writing = true;
      return Next::kWrite;
    }
    if (!writing && !reading && ready.empty() && delayed == 0 && (reads_done || broken)) {
      finishing = true;
      return Next::kFinish;
    }
    return Next::kNothing;
  }
  grpc::Status FinishStatus() const {
    return broken ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed") : grpc::Status::OK;
  }

  std::deque<EchoReply> ready;  // replies to write, in order (the front one being written)
  int delayed = 0;              // replies still in DelayedReplies
  bool reading = false;         // a read is outstanding
  bool writing = false;         // a write is outstanding
  bool reads_done = false;
  bool broken = false;
  bool finishing = false;
};

// Unary Echo on the callback API (both callback services).
grpc::ServerUnaryReactor* EchoUnary(grpc::CallbackServerContext* context,
                                    const EchoRequest* request, EchoReply* reply) {
  reply->set_o(request->q());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

class EchoService final : public Echo::CallbackService {
 public:
  // `delayed`: where EchoStream's replies wait, or null to write them at once.
  EchoService(DelayedReplies* delayed, bool read_ahead)
      : delayed_(delayed), read_ahead_(read_ahead) {}

 private:
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context, const EchoRequest* request,
                                 EchoReply* reply) override {
    return EchoUnary(context, request, reply);
  }

  // Read one request, write its reply, repeat until the client half-closes.
  // With `read_ahead`, the next read is started as soon as a request is read, before its reply
  // is written (as the attention server's streams do), instead of after the write. ReplyFlow
  // orders the writes and the Finish.
  class StreamReactor final : public grpc::ServerBidiReactor<EchoRequest, EchoReply> {
   public:
    StreamReactor(DelayedReplies* delayed, bool read_ahead)
        : delayed_(delayed), read_ahead_(read_ahead) {
      Read();
    }

   private:
    void OnReadDone(bool ok) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (flow_.ReadDone(ok)) {
        EchoReply reply;
        reply.set_o(request_.q());
        if (read_ahead_) Read();
        if (delayed_ != nullptr) {
          ++flow_.delayed;
          delayed_->Queue([this, reply = std::move(reply)] {
            std::lock_guard<std::mutex> lock(mu_);
            --flow_.delayed;
            flow_.Ready(reply);
            Pump();
          });
        } else {
          flow_.Ready(std::move(reply));
        }
      }
      Pump();
    }
    void OnWriteDone(bool ok) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (flow_.Written(ok, read_ahead_)) Read();
      Pump();
    }
    void OnDone() override { delete this; }

    void Read() {  // needs mu_
      flow_.reading = true;
      StartRead(&request_);
    }
    void Pump() {  // needs mu_
      switch (flow_.Pump()) {
        case ReplyFlow::Next::kWrite:
          StartWrite(&flow_.ready.front());  // kept until written
          break;
        case ReplyFlow::Next::kFinish:
          Finish(flow_.FinishStatus());
          break;
        case ReplyFlow::Next::kNothing:
          break;
      }
    }

    DelayedReplies* const delayed_;
    const bool read_ahead_;
    std::mutex mu_;  // the reactions may run at once on gRPC's threads
    EchoRequest request_;
    ReplyFlow flow_;
  };

  grpc::ServerBidiReactor<EchoRequest, EchoReply>* EchoStream(
      grpc::CallbackServerContext* /*context*/) override {
    return new StreamReactor(delayed_, read_ahead_);
  }

  DelayedReplies* const delayed_;
  const bool read_ahead_;
};

// Unary Echo on the callback API, EchoStream on the async API: PolledStreams serves it.
class PolledEchoService final
    : public Echo::WithCallbackMethod_Echo<Echo::WithAsyncMethod_EchoStream<Echo::Service>> {
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context, const EchoRequest* request,
                                 EchoReply* reply) override {
    return EchoUnary(context, request, reply);
  }
};

// EchoStream calls on the async API, one thread polling their completion queue without sleeping:
// it accepts each call, reads, and writes each reply (at once, or from DelayedReplies' thread,
// which may start an async write itself), so every completion is seen the moment it happens.
// ReplyFlow orders each call's writes and its Finish, as on the callback API.
class PolledStreams {
 public:
  PolledStreams(PolledEchoService* service, std::unique_ptr<grpc::ServerCompletionQueue> cq,
                DelayedReplies* delayed, bool read_ahead)
      : service_(service), cq_(std::move(cq)), delayed_(delayed), read_ahead_(read_ahead) {}

  // Serves until the queue is shut down (after the server's Shutdown).
  void Run() {
    Call::Accept(this);
    void* tag = nullptr;
    bool ok = false;
    while (true) {
      switch (cq_->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC))) {
        case grpc::CompletionQueue::GOT_EVENT: {
          Op* op = static_cast<Op*>(tag);
          op->call->Done(op->kind, ok);
          break;
        }
        case grpc::CompletionQueue::TIMEOUT:
          break;
        case grpc::CompletionQueue::SHUTDOWN:
          return;
      }
    }
  }
  void Shutdown() { cq_->Shutdown(); }

 private:
  class Call;
  enum class Kind { kAccepted, kRead, kWritten, kFinished };
  struct Op {  // a tag: which call, which operation
    Call* call;
    Kind kind;
  };

  // One EchoStream call. It owns itself (self_) until its Finish completes; a reply waiting in
  // DelayedReplies holds it too, so a call that ends meanwhile outlives the wait.
  class Call : public std::enable_shared_from_this<Call> {
   public:
    // Asks gRPC for the next call.
    static void Accept(PolledStreams* owner) {
      auto call = std::make_shared<Call>(owner);
      call->self_ = call;
      owner->service_->RequestEchoStream(&call->context_, &call->stream_, owner->cq_.get(),
                                         owner->cq_.get(), &call->accepted_);
    }
    explicit Call(PolledStreams* owner) : owner_(owner), stream_(&context_) {}

    // One completion (on the polling thread).
    void Done(Kind kind, bool ok) {
      std::shared_ptr<Call> keep;  // released after the lock
      std::lock_guard<std::mutex> lock(mu_);
      switch (kind) {
        case Kind::kAccepted:
          if (!ok) {  // the server is shutting down: no call came
            keep = std::move(self_);
            return;
          }
          Accept(owner_);  // the next call
          Read();
          return;
        case Kind::kRead:
          if (flow_.ReadDone(ok)) {
            EchoReply reply;
            reply.set_o(request_.q());
            if (owner_->read_ahead_) Read();
            if (owner_->delayed_ != nullptr) {
              ++flow_.delayed;
              owner_->delayed_->Queue([call = shared_from_this(), reply = std::move(reply)] {
                std::lock_guard<std::mutex> lock(call->mu_);
                --call->flow_.delayed;
                call->flow_.Ready(reply);
                call->Pump();
              });
            } else {
              flow_.Ready(std::move(reply));
            }
          }
          Pump();
          return;
        case Kind::kWritten:
          if (flow_.Written(ok, owner_->read_ahead_)) Read();
          Pump();
          return;
        case Kind::kFinished:
          keep = std::move(self_);
          return;
      }
    }

   private:
    void Read() {  // needs mu_
      flow_.reading = true;
      stream_.Read(&request_, &read_);
    }
    void Pump() {  // needs mu_
      switch (flow_.Pump()) {
        case ReplyFlow::Next::kWrite:
          stream_.Write(flow_.ready.front(), &written_);
          break;
        case ReplyFlow::Next::kFinish:
          stream_.Finish(flow_.FinishStatus(), &finished_);
          break;
        case ReplyFlow::Next::kNothing:
          break;
      }
    }

    PolledStreams* const owner_;
    Op accepted_{this, Kind::kAccepted}, read_{this, Kind::kRead}, written_{this, Kind::kWritten},
        finished_{this, Kind::kFinished};
    std::mutex mu_;  // the delay thread pumps while the poller handles completions
    std::shared_ptr<Call> self_;
    grpc::ServerContext context_;
    grpc::ServerAsyncReaderWriter<EchoReply, EchoRequest> stream_;
    EchoRequest request_;
    ReplyFlow flow_;
  };

  PolledEchoService* const service_;
  const std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  DelayedReplies* const delayed_;
  const bool read_ahead_;
};

// The same service on the synchronous API: gRPC's sync server runs each call on a thread of its
// pool, which blocks in Read and Write (polling the connection itself).
class SyncEchoService final : public Echo::Service {
  grpc::Status Echo(grpc::ServerContext* /*context*/, const EchoRequest* request,
                    EchoReply* reply) override {
    reply->set_o(request->q());
    return grpc::Status::OK;
  }

  grpc::Status EchoStream(grpc::ServerContext* /*context*/,
                          grpc::ServerReaderWriter<EchoReply, EchoRequest>* stream) override {
    EchoRequest request;
    EchoReply reply;
    while (stream->Read(&request)) {
      reply.set_o(request.q());
      if (!stream->Write(reply)) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
      }
    }
    return grpc::Status::OK;
  }
};

volatile std::sig_atomic_t g_stop = 0;

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  // Lock-order checks off, as in attention_server (server/main.cc says why).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "Serves attention.bench.Echo (the transport anchor of attn_bench) over gRPC.");
  // --help lists this file's flags (abseil's default looks for a file named like the program).
  const auto own_flags = [](absl::string_view file) { return file == __FILE__; };
  absl::SetFlagsUsageConfig(
      {.contains_helpshort_flags = own_flags, .contains_help_flags = own_flags});
  absl::ParseCommandLine(argc, argv);
  std::unique_ptr<attention::bench::DelayedReplies> delayed;
  if (const int us = absl::GetFlag(FLAGS_reply_delay_us); us > 0) {
    delayed = std::make_unique<attention::bench::DelayedReplies>(std::chrono::microseconds(us));
  }
  attention::bench::EchoService callback_service(delayed.get(), absl::GetFlag(FLAGS_read_ahead));
  attention::bench::SyncEchoService sync_service;
  attention::bench::PolledEchoService polled_service;
  const int max_bytes = absl::GetFlag(FLAGS_max_message_mb) * (1 << 20);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  const std::string unix_socket = absl::GetFlag(FLAGS_unix_socket);
  if (!unix_socket.empty()) {
    struct stat st;  // a socket left by an earlier run goes; anything else stays (the bind fails)
    if (lstat(unix_socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(unix_socket.c_str());
    builder.AddListeningPort(absl::StrCat("unix:", unix_socket), grpc::InsecureServerCredentials());
  }
  const bool poll = absl::GetFlag(FLAGS_poll);
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  if (absl::GetFlag(FLAGS_sync)) {
    builder.RegisterService(&sync_service);
  } else if (poll) {
    builder.RegisterService(&polled_service);
    cq = builder.AddCompletionQueue();
  } else {
    builder.RegisterService(&callback_service);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "attn_echo_server: cannot listen on %s:%d\n",
                 absl::GetFlag(FLAGS_host).c_str(), absl::GetFlag(FLAGS_port));
    return 1;
  }
  std::fprintf(stderr, "attn_echo_server: listening on %s:%d%s%s (%s)\n",
               absl::GetFlag(FLAGS_host).c_str(), port,
               unix_socket.empty() ? "" : " and unix:", unix_socket.c_str(),
               absl::GetFlag(FLAGS_sync) ? "sync API"
               : poll                    ? "callback API, EchoStream on the async API, polled"
                                         : "callback API");
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    std::ofstream(path) << port << "\n";
  }
  // SIGINT/SIGTERM end the server; the main thread polls the flag (a handler may do no more).
  std::signal(SIGINT, [](int) { attention::bench::g_stop = 1; });
  std::signal(SIGTERM, [](int) { attention::bench::g_stop = 1; });
  std::unique_ptr<attention::bench::PolledStreams> streams;
  std::thread poller;
  if (poll) {
    streams = std::make_unique<attention::bench::PolledStreams>(
        &polled_service, std::move(cq), delayed.get(), absl::GetFlag(FLAGS_read_ahead));
    poller = std::thread([&streams] { streams->Run(); });
  }
  while (!attention::bench::g_stop) pause();
  server->Shutdown();
  if (streams != nullptr) {
    delayed.reset();      // its thread starts the writes still queued (they fail), then ends
    streams->Shutdown();  // after the server's: the poller drains what is left, then returns
    poller.join();
  }
  return 0;
}
