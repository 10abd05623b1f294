// Pieces the reliability tests share beyond tests/e2e's: test certificates made with the openssl
// CLI, TLS channels and the server's resident memory.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
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

// The status of one unary call of `method` ("/attention.v1.Attention/Attend") on `channel`
// carrying `bytes` as they are (any bytes: the server parses them), gzip-compressed when asked.
grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                          const std::string& bytes, bool gzip = false);

// Resident set size of process `pid` in bytes (VmRSS), or an error.
absl::StatusOr<int64_t> ResidentBytes(pid_t pid);

}  // namespace attention::reliability
