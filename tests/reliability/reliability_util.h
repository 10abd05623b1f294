// Pieces the reliability tests share beyond tests/e2e's: test certificates made with the openssl
// CLI, TLS channels, the server's resident memory, metrics read from /metrics, and a request that
// keeps a CPU worker busy for a set time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "grpcpp/grpcpp.h"

namespace attention::reliability {

// A temporary directory, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // Writes `contents` to `name` inside the directory and returns its path.
  std::string Write(const std::string& name, const std::string& contents) const;

 private:
  std::string path_;
};

// PEM files in a directory: a CA, a server certificate it signed for localhost and 127.0.0.1, a
// client certificate it signed, and a client certificate from an unrelated CA.
struct Certificates {
  std::string ca_cert;  // paths
  std::string server_cert, server_key;
  std::string client_cert, client_key;
  std::string rogue_client_cert, rogue_client_key;  // signed by another CA
};

// Generates fresh P-256 certificates valid for a day with the openssl CLI.
absl::StatusOr<Certificates> GenerateCertificates(const std::string& dir);

// The whole file at `path` ("" when unreadable).
std::string ReadFile(const std::string& path);

// A TLS channel to `target`, trusting `ca_cert_pem`, presenting the client certificate when given.
std::shared_ptr<grpc::Channel> TlsChannel(const std::string& target, const std::string& ca_cert_pem,
                                          const std::string& client_cert_pem = "",
                                          const std::string& client_key_pem = "");

// Resident set size of process `pid` in bytes (VmRSS), or an error.
absl::StatusOr<int64_t> ResidentBytes(pid_t pid);

// The sum of `name`'s samples with `labels` on the server's /metrics.
absl::StatusOr<double> ScrapeMetric(int metrics_port, const std::string& name,
                                    const std::map<std::string, std::string>& labels = {});

// Polls `name` (with `labels`) on /metrics until `done` holds for it or 30 s pass; returns the
// last value read (-1 when no scrape succeeded).
double WaitForMetric(int metrics_port, const std::string& name,
                     const std::map<std::string, std::string>& labels,
                     const std::function<bool(double)>& done);

// Waits until a device runs a batch (attention_device_running_batches >= 1), so that requests
// sent from now on queue behind it; false after 30 s. (A request counted in flight may still be
// decoding: a small one sent then can overtake a large one.)
bool WaitUntilRunning(int metrics_port);

// A request that keeps one CPU worker busy for about `busy` whatever the build (a sanitizer slows
// the kernel up to fifty-fold, a loaded machine more): `client`'s server first answers a
// calibration request, q, k, v [1, 4, 1024, 16] (0.27 GFLOP), and the blocker, q, k, v
// [1, 16, seqlen, 64] float32 with seqlen in [512, 4096], is sized from the speed it measured.
// Its float64 reference costs the client more than the server's run, so tests check only its
// answer's size; correctness is other tests' subject.
struct Blocker {
  v1::AttendRequest request;
  int64_t seqlen = 0;
  double flops = 0;  // 4 * 16 * 64 * seqlen^2
};
absl::StatusOr<Blocker> CalibratedBlocker(client::Client& client, absl::Duration busy,
                                          std::mt19937_64& rng);

}  // namespace attention::reliability
