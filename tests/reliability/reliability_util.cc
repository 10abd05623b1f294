#include "tests/reliability/reliability_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/request_builder.h"
#include "tests/e2e/metrics_scrape.h"

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

absl::StatusOr<int64_t> ResidentBytes(pid_t pid) {
  std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %ld kB", &kib) == 1) return kib * 1024;
  }
  return absl::NotFoundError(absl::StrCat("no VmRSS for pid ", pid));
}

absl::StatusOr<double> ScrapeMetric(int metrics_port, const std::string& name,
                                    const std::map<std::string, std::string>& labels) {
  absl::StatusOr<std::string> text = e2e::HttpGet(metrics_port, "/metrics");
  if (!text.ok()) return text.status();
  return e2e::SumSamples(e2e::ParseMetrics(*text), name, labels);
}

double WaitForMetric(int metrics_port, const std::string& name,
                     const std::map<std::string, std::string>& labels,
                     const std::function<bool(double)>& done) {
  double value = -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    absl::StatusOr<double> v = ScrapeMetric(metrics_port, name, labels);
    if (v.ok()) {
      value = *v;
      if (done(value)) break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return value;
}

bool WaitUntilRunning(int metrics_port) {
  return WaitForMetric(metrics_port, "attention_device_running_batches", {},
                       [](double v) { return v >= 1; }) >= 1;
}

absl::StatusOr<Blocker> CalibratedBlocker(client::Client& client, absl::Duration busy,
                                          std::mt19937_64& rng) {
  constexpr int64_t kCalibrationN = 1024;
  absl::StatusOr<v1::AttendRequest> calibration =
      client::MakeRandomRequest({.batch = 1,
                                 .heads_q = 4,
                                 .heads_kv = 4,
                                 .seqlen_q = kCalibrationN,
                                 .seqlen_k = kCalibrationN,
                                 .head_dim = 16},
                                rng);
  if (!calibration.ok()) return calibration.status();
  absl::StatusOr<v1::AttendResponse> calibrated = client.Attend(*calibration);
  if (!calibrated.ok()) return calibrated.status();
  const double flops_per_us = 4.0 * 4 * 16 * kCalibrationN * kCalibrationN /
                              std::max(1.0, calibrated->timing().compute_us());
  const double flops_per_token_pair = 4.0 * 16 * 64;
  Blocker blocker;
  blocker.seqlen =
      std::clamp<int64_t>(static_cast<int64_t>(std::sqrt(absl::ToDoubleMicroseconds(busy) *
                                                         flops_per_us / flops_per_token_pair)),
                          512, 4096);
  blocker.flops = flops_per_token_pair * static_cast<double>(blocker.seqlen * blocker.seqlen);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest({.batch = 1,
                                                                         .heads_q = 16,
                                                                         .heads_kv = 16,
                                                                         .seqlen_q = blocker.seqlen,
                                                                         .seqlen_k = blocker.seqlen,
                                                                         .head_dim = 64},
                                                                        rng);
  if (!request.ok()) return request.status();
  blocker.request = *std::move(request);
  return blocker;
}

}  // namespace attention::reliability
