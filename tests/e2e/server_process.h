// Runs the real attention_server binary as a child process for end-to-end tests: picks free
// ports (--port=0 --metrics_port=0), learns them from --port_file, captures the server's output
// in a log file, and stops it with SIGTERM, expecting a clean exit. The child is killed if the
// thread that started it dies, so a test killed mid-run leaves no server behind.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attention::e2e {

struct ServerProcessOptions {
  // The binary; the build passes the path of the attention_server target.
  std::string binary = ATTENTION_SERVER_BINARY;
  // Extra flags, e.g. {"--backend=cpu", "--max_queue=1"}.
  std::vector<std::string> flags;
  // Append ATTENTION_E2E_EXTRA_FLAGS (server_process.cc); off for a server whose own flags must
  // stand, e.g. a test of the CPU backend's several devices under a suite pointed at a GPU.
  bool environment_flags = true;
  // How long the server may take to write its port file.
  absl::Duration start_timeout = absl::Seconds(30);
};

class ServerProcess {
 public:
  // Starts the server and waits until it listens. On failure the child is killed and the error
  // carries its output.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const ServerProcessOptions& options);

  // Kills the child (SIGKILL) if it is still running and removes its temporary files.
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // "127.0.0.1:<port>" for a gRPC channel.
  std::string target() const;
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }

  absl::Status Signal(int signal);

  // Waits for the child to exit and returns its exit code (128 + signal when a signal killed
  // it). After `timeout` the child is killed with SIGKILL and the result is DEADLINE_EXCEEDED.
  absl::StatusOr<int> WaitForExit(absl::Duration timeout);

  // SIGTERM, then waits up to `timeout`; OK only when the server exited with code 0.
  absl::Status Stop(absl::Duration timeout = absl::Seconds(30));

  // What the server wrote to stdout and stderr so far.
  std::string Log() const;

 private:
  ServerProcess(pid_t pid, std::string dir) : pid_(pid), dir_(std::move(dir)) {}

  pid_t pid_;
  bool exited_ = false;
  std::string dir_;  // temporary directory: port file and log
  int port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace attention::e2e
