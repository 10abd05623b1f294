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
// pipeline; one message in flight here), instead of once the reply is written.
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
          "Callback API, EchoStream: start the next read as soon as a request is read, before "
          "its reply is written, as the attention server does.");

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

class EchoService final : public Echo::CallbackService {
 public:
  // `delayed`: where EchoStream's replies wait, or null to write them at once.
  EchoService(DelayedReplies* delayed, bool read_ahead)
      : delayed_(delayed), read_ahead_(read_ahead) {}

 private:
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context, const EchoRequest* request,
                                 EchoReply* reply) override {
    reply->set_o(request->q());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // Read one request, write its reply, repeat until the client half-closes.
  // With `read_ahead`, the next read is started as soon as a request is read, before its reply
  // is written (as the attention server's streams do), instead of after the write.
  class StreamReactor final : public grpc::ServerBidiReactor<EchoRequest, EchoReply> {
   public:
    StreamReactor(DelayedReplies* delayed, bool read_ahead)
        : delayed_(delayed), read_ahead_(read_ahead) {
      StartRead(&request_);
    }

   private:
    void OnReadDone(bool ok) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) {
        reads_done_ = true;
        if (!writing_) Finish(grpc::Status::OK);
        return;
      }
      reply_.set_o(request_.q());
      writing_ = true;
      if (read_ahead_) StartRead(&request_);
      if (delayed_ != nullptr) {
        delayed_->Queue([this] {
          std::lock_guard<std::mutex> lock(mu_);
          StartWrite(&reply_);
        });
      } else {
        StartWrite(&reply_);
      }
    }
    void OnWriteDone(bool ok) override {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
        return;
      }
      if (reads_done_) {
        Finish(grpc::Status::OK);
      } else if (!read_ahead_) {
        StartRead(&request_);
      }
    }
    void OnDone() override { delete this; }

    DelayedReplies* const delayed_;
    const bool read_ahead_;
    std::mutex mu_;  // the reactions may run at once on gRPC's threads
    bool writing_ = false;
    bool reads_done_ = false;
    EchoRequest request_;
    EchoReply reply_;
  };

  grpc::ServerBidiReactor<EchoRequest, EchoReply>* EchoStream(
      grpc::CallbackServerContext* /*context*/) override {
    return new StreamReactor(delayed_, read_ahead_);
  }

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
  if (absl::GetFlag(FLAGS_sync)) {
    builder.RegisterService(&sync_service);
  } else {
    builder.RegisterService(&callback_service);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "attn_echo_server: cannot listen on %s:%d\n",
                 absl::GetFlag(FLAGS_host).c_str(), absl::GetFlag(FLAGS_port));
    return 1;
  }
  std::fprintf(stderr, "attn_echo_server: listening on %s:%d%s%s (%s API)\n",
               absl::GetFlag(FLAGS_host).c_str(), port,
               unix_socket.empty() ? "" : " and unix:", unix_socket.c_str(),
               absl::GetFlag(FLAGS_sync) ? "sync" : "callback");
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    std::ofstream(path) << port << "\n";
  }
  // SIGINT/SIGTERM end the server; the main thread polls the flag (a handler may do no more).
  std::signal(SIGINT, [](int) { attention::bench::g_stop = 1; });
  std::signal(SIGTERM, [](int) { attention::bench::g_stop = 1; });
  while (!attention::bench::g_stop) pause();
  server->Shutdown();
  return 0;
}
