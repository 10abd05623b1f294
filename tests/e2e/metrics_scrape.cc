#include "tests/e2e/metrics_scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention::e2e {

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("connect to port ", port, ": ", std::strerror(error)));
  }
  // HTTP/1.0 without keep-alive: the server closes the connection after the body.
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = write(fd, request.data() + sent, request.size() - sent);
    if (n <= 0) {
      close(fd);
      return absl::UnavailableError("writing the HTTP request failed");
    }
    sent += n;
  }
  std::string response;
  char buffer[8192];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);

  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return absl::DataLossError("HTTP response without a header end");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (!absl::StrContains(status_line, " 200")) {
    return absl::UnavailableError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return response.substr(body + 4);
}

std::vector<MetricSample> ParseMetrics(const std::string& text) {
  std::vector<MetricSample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    MetricSample sample;
    // name{label="value",...} value [timestamp]; label values here hold no '"' or ','.
    const size_t brace = line.find('{');
    const size_t space = line.find(' ');
    absl::string_view rest;
    if (brace != absl::string_view::npos && brace < space) {
      sample.name = std::string(line.substr(0, brace));
      const size_t close = line.find('}', brace);
      if (close == absl::string_view::npos) continue;
      for (absl::string_view pair :
           absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',', absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        if (eq == absl::string_view::npos) continue;
        absl::string_view value = pair.substr(eq + 1);
        absl::ConsumePrefix(&value, "\"");
        absl::ConsumeSuffix(&value, "\"");
        sample.labels[std::string(pair.substr(0, eq))] = std::string(value);
      }
      rest = line.substr(close + 1);
    } else {
      sample.name = std::string(line.substr(0, space));
      rest = line.substr(space);
    }
    const std::vector<absl::string_view> fields = absl::StrSplit(rest, ' ', absl::SkipEmpty());
    if (fields.empty()) continue;
    // "+Inf", "-Inf" and "NaN" are valid sample values; strtod reads all three.
    sample.value = std::strtod(std::string(fields[0]).c_str(), nullptr);
    samples.push_back(std::move(sample));
  }
  return samples;
}

namespace {

bool Matches(const MetricSample& sample, const std::string& name,
             const std::map<std::string, std::string>& labels) {
  if (sample.name != name) return false;
  for (const auto& [key, value] : labels) {
    auto it = sample.labels.find(key);
    if (it == sample.labels.end() || it->second != value) return false;
  }
  return true;
}

}  // namespace

double SumSamples(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& labels) {
  double sum = 0;
  for (const MetricSample& s : samples) {
    if (Matches(s, name, labels)) sum += s.value;
  }
  return sum;
}

bool HasSample(const std::vector<MetricSample>& samples, const std::string& name,
               const std::map<std::string, std::string>& labels) {
  for (const MetricSample& s : samples) {
    if (Matches(s, name, labels)) return true;
  }
  return false;
}

absl::StatusOr<double> ScrapeMetric(int metrics_port, const std::string& name,
                                    const std::map<std::string, std::string>& labels) {
  absl::StatusOr<std::string> text = HttpGet(metrics_port, "/metrics");
  if (!text.ok()) return text.status();
  return SumSamples(ParseMetrics(*text), name, labels);
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

}  // namespace attention::e2e
