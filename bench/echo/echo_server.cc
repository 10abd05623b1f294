// attn_echo_server: serves attention.bench.Echo (echo.proto) over gRPC's callback API with the
// same message limits as the attention server, so attn_bench --echo measures the transport alone.
//
//   attn_echo_server --port=50061            # or --port=0 --port_file=/tmp/echo.port
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "bench/echo/echo.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(int, port, 50061, "Port; 0 picks a free one.");
ABSL_FLAG(std::string, port_file, "", "When set, the chosen port is written here once listening.");
ABSL_FLAG(int, max_message_mb, 1024, "Largest message received or sent, MiB.");

namespace attention::bench {
namespace {

class EchoService final : public Echo::CallbackService {
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* context, const EchoRequest* request,
                                 EchoReply* reply) override {
    reply->set_o(request->q());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // Read one request, write its reply, repeat until the client half-closes.
  class StreamReactor final : public grpc::ServerBidiReactor<EchoRequest, EchoReply> {
   public:
    StreamReactor() { StartRead(&request_); }

   private:
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      reply_.set_o(request_.q());
      StartWrite(&reply_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
        return;
      }
      StartRead(&request_);
    }
    void OnDone() override { delete this; }

    EchoRequest request_;
    EchoReply reply_;
  };

  grpc::ServerBidiReactor<EchoRequest, EchoReply>* EchoStream(
      grpc::CallbackServerContext* /*context*/) override {
    return new StreamReactor();
  }
};

volatile std::sig_atomic_t g_stop = 0;

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves attention.bench.Echo (the transport anchor of attn_bench) over gRPC.");
  // --help lists this file's flags (abseil's default looks for a file named like the program).
  const auto own_flags = [](absl::string_view file) { return file == __FILE__; };
  absl::SetFlagsUsageConfig(
      {.contains_helpshort_flags = own_flags, .contains_help_flags = own_flags});
  absl::ParseCommandLine(argc, argv);
  attention::bench::EchoService service;
  const int max_bytes = absl::GetFlag(FLAGS_max_message_mb) * (1 << 20);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "attn_echo_server: cannot listen on %s:%d\n",
                 absl::GetFlag(FLAGS_host).c_str(), absl::GetFlag(FLAGS_port));
    return 1;
  }
  std::fprintf(stderr, "attn_echo_server: listening on %s:%d\n", absl::GetFlag(FLAGS_host).c_str(),
               port);
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
