#include "tests/reliability/reliability_util.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"

namespace attention::reliability {
namespace {

// A gRPC client whose channel is idle polls its connection only every 5 s (the backup poller), so
// it notices a draining server's GOAWAY late, and the server's shutdown waits for it to hang up.
// The tests keep idle clients open across shutdowns; a 100 ms poll keeps them from stretching
// every stop by seconds. Set before the first channel exists, when gRPC reads it.
const bool kFastIdlePolling =
    setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", /*overwrite=*/0) == 0;

}  // namespace

TempDir::TempDir() {
  std::string dir = (std::filesystem::temp_directory_path() / "attention_rel.XXXXXX").string();
  if (mkdtemp(dir.data()) != nullptr) path_ = dir;
}

TempDir::~TempDir() {
  if (!path_.empty()) std::filesystem::remove_all(path_);
}

std::string TempDir::Write(const std::string& name, const std::string& contents) const {
  const std::string file = path_ + "/" + name;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << contents;
  return file;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

absl::StatusOr<Certificates> GenerateCertificates(const std::string& dir) {
  const std::string d = dir + "/";
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  // A leaf certificate signed by `ca` for `usage`, with `san` when given.
  auto leaf = [&](const std::string& name, const std::string& ca, const std::string& cn,
                  const std::string& usage, const std::string& san) {
    std::string ext = absl::StrCat("extendedKeyUsage=", usage, "\n");
    if (!san.empty()) absl::StrAppend(&ext, "subjectAltName=", san, "\n");
    std::ofstream(d + name + ".ext") << ext;
    return absl::StrCat("openssl req ", key, " -keyout ", d, name, ".key -out ", d, name,
                        ".csr -subj /CN=", cn, " && openssl x509 -req -in ", d, name, ".csr -CA ",
                        d, ca, ".pem -CAkey ", d, ca, ".key -CAcreateserial -days 1 -out ", d, name,
                        ".pem -extfile ", d, name, ".ext");
  };
  auto ca = [&](const std::string& name) {
    return absl::StrCat("openssl req -x509 ", key, " -keyout ", d, name, ".key -out ", d, name,
                        ".pem -days 1 -subj /CN=", name);
  };
  const std::vector<std::string> commands = {
      ca("test-ca"),
      ca("rogue-ca"),
      leaf("server", "test-ca", "localhost", "serverAuth", "DNS:localhost,IP:127.0.0.1"),
      leaf("client", "test-ca", "test-client", "clientAuth", ""),
      leaf("rogue-client", "rogue-ca", "rogue-client", "clientAuth", ""),
  };
  for (const std::string& command : commands) {
    const std::string logged = absl::StrCat("(", command, ") >", d, "openssl.log 2>&1");
    if (std::system(logged.c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("openssl failed: ", command, "\n", ReadFile(d + "openssl.log")));
    }
  }
  return Certificates{.ca_cert = d + "test-ca.pem",
                      .server_cert = d + "server.pem",
                      .server_key = d + "server.key",
                      .client_cert = d + "client.pem",
                      .client_key = d + "client.key",
                      .rogue_client_cert = d + "rogue-client.pem",
                      .rogue_client_key = d + "rogue-client.key"};
}

std::shared_ptr<grpc::Channel> TlsChannel(const std::string& target, const std::string& ca_cert_pem,
                                          const std::string& client_cert_pem,
                                          const std::string& client_key_pem) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca_cert_pem;
  ssl.pem_cert_chain = client_cert_pem;
  ssl.pem_private_key = client_key_pem;
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(ssl),
                                   client::MakeChannelArguments({}));
}

grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                          const std::string& bytes, bool gzip) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (gzip) context.set_compression_algorithm(GRPC_COMPRESS_GZIP);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, method, {}, &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

absl::StatusOr<int64_t> ResidentBytes(pid_t pid) {
  std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %ld kB", &kib) == 1) return kib * 1024;
  }
  return absl::NotFoundError(absl::StrCat("no VmRSS for pid ", pid));
}

}  // namespace attention::reliability
