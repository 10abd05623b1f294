// attention_server: serves attention.v1.Attention over gRPC, with health, reflection and
// Prometheus metrics. Flags are read here only and handed on as option structs.
//
// Shutdown on SIGTERM or SIGINT: health turns NOT_SERVING, new requests are answered UNAVAILABLE,
// requests already accepted finish (for up to --shutdown_grace_s, then they are cancelled), and
// the process exits 0.
//
// Security (security.h): --tls_cert/--tls_key serve TLS, --tls_client_ca adds mutual TLS, and
// --auth_token_file requires a bearer token on every Attention call; health stays open.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/attention_service.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/security.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on (gRPC and metrics).");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one.");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port; 0 picks a free one.");
ABSL_FLAG(std::string, backend, "auto",
          "auto | cpu | cuda. auto: cuda when a GPU is visible, else cpu.");
ABSL_FLAG(int, threads, 0, "CPU backend compute threads; 0 = all cores.");
ABSL_FLAG(int, workers, 2, "Scheduler worker threads (requests run at once).");
ABSL_FLAG(int, max_message_mb, 1024, "Largest gRPC message received or sent, MiB (1..2047).");
ABSL_FLAG(int, max_queue, 256, "Requests that may wait for a device; more are refused.");
ABSL_FLAG(int, max_batch, 1, "Requests per kernel launch (reported in ServerInfo).");
ABSL_FLAG(int, shutdown_grace_s, 30, "Seconds in-flight requests get to finish on shutdown.");
ABSL_FLAG(std::string, port_file, "",
          "If set, \"<grpc_port> <metrics_port>\\n\" is written here once both ports listen.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for TLS on the gRPC port; empty = plaintext. Needs --tls_key.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token; when set, every attention.v1.Attention call must send "
          "'authorization: Bearer <token>' (health checks stay open).");

namespace attention::server {
namespace {

constexpr char kServiceName[] = "attention.v1.Attention";

std::string HostPort(const std::string& host, int port) {
  // IPv6 literals need brackets.
  return host.find(':') == std::string::npos ? absl::StrCat(host, ":", port)
                                             : absl::StrCat("[", host, "]:", port);
}

// Writes `contents` to `path` atomically: readers see the whole file or none.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    out << contents;
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", temp));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path));
  }
  return absl::OkStatus();
}

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;
  int metrics_port = 9464;
  std::string backend = "auto";
  int threads = 0;
  int shutdown_grace_s = 30;
  std::string port_file;
  SecurityOptions security;
  SchedulerOptions scheduler;
  ServiceOptions service;
};

absl::Status CheckOptions(const ServerOptions& o, int max_message_mb) {
  if (o.backend != "auto" && o.backend != "cpu" && o.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend: expected auto, cpu or cuda, got ", o.backend));
  }
  if (max_message_mb < 1 || max_message_mb > 2047) {  // gRPC limits are int bytes
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb: expected 1..2047, got ", max_message_mb));
  }
  for (const auto& [name, value] : {std::pair{"--workers", o.scheduler.workers},
                                    {"--max_queue", o.scheduler.max_queue},
                                    {"--max_batch", o.service.max_batch}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 1, got ", value));
    }
  }
  if (o.threads < 0 || o.shutdown_grace_s < 0 || o.port < 0 || o.metrics_port < 0) {
    return absl::InvalidArgumentError(
        "--threads, --shutdown_grace_s, --port and --metrics_port must be >= 0");
  }
  return absl::OkStatus();
}

// One executor per device of the chosen backend ("auto" resolved into o->backend).
absl::StatusOr<std::vector<std::unique_ptr<Executor>>> MakeExecutors(ServerOptions* o) {
  const int gpus = CudaDeviceCount();
  if (o->backend == "auto") o->backend = gpus > 0 ? "cuda" : "cpu";
  std::vector<std::unique_ptr<Executor>> executors;
  if (o->backend == "cpu") {
    executors.push_back(MakeCpuExecutor(o->threads));
    return executors;
  }
  if (gpus == 0) {
    return absl::FailedPreconditionError(
        "--backend=cuda: no CUDA device is visible (or this build has no CUDA); use --backend=cpu");
  }
  for (int i = 0; i < gpus; ++i) {
    absl::StatusOr<std::unique_ptr<Executor>> executor = MakeCudaExecutor(i);
    if (!executor.ok()) return executor.status();
    executors.push_back(*std::move(executor));
  }
  return executors;
}

int Run(ServerOptions options, const sigset_t& stop_signals) {
  absl::StatusOr<std::vector<std::unique_ptr<Executor>>> executors = MakeExecutors(&options);
  if (!executors.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", executors.status().ToString().c_str());
    return 1;
  }
  options.service.backend = options.backend;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.security);
  if (!credentials.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", credentials.status().ToString().c_str());
    return 2;
  }
  if (!options.security.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadAuthToken(options.security.auth_token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "attention_server: %s\n", token.status().ToString().c_str());
      return 2;
    }
    options.service.auth_token = *std::move(token);
  }
  Metrics metrics(BuildInfo{.version = options.service.version,
                            .backend = options.backend,
                            .cuda = ATTENTION_CUDA_VERSION});
  for (const auto& executor : *executors) {
    metrics.SetDeviceMemoryTotal(executor->device().name, executor->device().memory_bytes);
  }
  absl::StatusOr<int> metrics_port = metrics.Serve(HostPort(options.host, options.metrics_port));
  if (!metrics_port.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", metrics_port.status().ToString().c_str());
    return 1;
  }

  Scheduler scheduler(*std::move(executors), options.scheduler,
                      [&metrics](int depth) { metrics.SetQueueDepth(depth); });
  // Declared after the scheduler, so it stops sampling the scheduler before the scheduler goes.
  const std::unique_ptr<Metrics::SchedulerWatch> watch = metrics.Watch(scheduler);
  AttentionService service(options.service, &scheduler, &metrics);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(HostPort(options.host, options.port), *credentials, &port);
  const int max_message = static_cast<int>(options.service.max_message_bytes);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "attention_server: cannot listen on %s\n",
                 HostPort(options.host, options.port).c_str());
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);

  if (!options.port_file.empty()) {
    absl::Status written =
        WriteFileAtomically(options.port_file, absl::StrCat(port, " ", *metrics_port, "\n"));
    if (!written.ok()) {
      std::fprintf(stderr, "attention_server: --port_file: %s\n", written.ToString().c_str());
      server->Shutdown();
      return 1;
    }
  }
  std::fprintf(stderr, "attention_server listening on %s (%s%s), metrics on :%d, backend %s\n",
               HostPort(options.host, port).c_str(),
               options.security.tls_cert.empty()
                   ? "plaintext"
                   : (options.security.tls_client_ca.empty() ? "TLS" : "mutual TLS"),
               options.service.auth_token.empty() ? "" : ", bearer token required",
               *metrics_port, options.backend.c_str());

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  std::fprintf(stderr, "attention_server: %s, draining (grace %d s)\n", strsignal(signal_number),
               options.shutdown_grace_s);
  health->SetServingStatus("", false);
  health->SetServingStatus(kServiceName, false);
  service.StartDraining();
  // Waits for calls in progress; at the deadline the rest are cancelled, which drops their
  // queued work, and Shutdown returns once every call has ended.
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::seconds(options.shutdown_grace_s));
  scheduler.Shutdown();
  std::fprintf(stderr, "attention_server: stopped\n");
  return 0;
}

}  // namespace
}  // namespace attention::server

int main(int argc, char** argv) {
  // Block the stop signals before any thread starts, so every thread inherits the mask and only
  // the sigwait in Run receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::SetProgramUsageMessage("Serves attention.v1.Attention over gRPC.");
  absl::ParseCommandLine(argc, argv);

  attention::server::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.security.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.security.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.security.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.scheduler.workers = absl::GetFlag(FLAGS_workers);
  options.scheduler.max_queue = absl::GetFlag(FLAGS_max_queue);
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.service.version = ATTENTION_VERSION;
  options.service.max_message_bytes = int64_t{max_message_mb} << 20;
  options.service.max_queue = options.scheduler.max_queue;
  options.service.max_batch = absl::GetFlag(FLAGS_max_batch);

  absl::Status valid = attention::server::CheckOptions(options, max_message_mb);
  if (!valid.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", valid.ToString().c_str());
    return 2;
  }
  return attention::server::Run(std::move(options), stop_signals);
}
