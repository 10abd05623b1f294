#include "server/metrics/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace attention::server {
namespace {

std::optional<std::string> ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type,
                                double value) {
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return prometheus::MetricFamily{
      .name = std::move(name), .help = std::move(help), .type = type, .metric = {metric}};
}

// When the process started, seconds since the epoch: its start in clock ticks after boot
// (/proc/self/stat field 22) plus the boot time (/proc/stat btime).
std::optional<double> StartTimeSeconds() {
  const std::optional<std::string> stat = ReadFile("/proc/self/stat");
  const std::optional<std::string> system = ReadFile("/proc/stat");
  if (!stat || !system) return std::nullopt;
  // Field 2, the command name, is in parentheses and may hold spaces; count fields after it.
  const size_t name_end = stat->rfind(')');
  if (name_end == std::string::npos) return std::nullopt;
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(*stat).substr(name_end + 1), ' ', absl::SkipEmpty());
  constexpr size_t kStartTimeAfterName = 22 - 3;  // field 3 is the first after the name
  int64_t start_ticks = 0;
  if (fields.size() <= kStartTimeAfterName ||
      !absl::SimpleAtoi(fields[kStartTimeAfterName], &start_ticks)) {
    return std::nullopt;
  }
  for (absl::string_view line : absl::StrSplit(*system, '\n')) {
    int64_t boot_seconds = 0;
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtoi(line, &boot_seconds)) {
      return static_cast<double>(boot_seconds) +
             static_cast<double>(start_ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  return std::nullopt;
}

}  // namespace

std::vector<prometheus::MetricFamily> CollectProcessMetrics() {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> families;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    const auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
    families.push_back(
        Family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
               MetricType::Counter, seconds(usage.ru_utime) + seconds(usage.ru_stime)));
  }
  // /proc/self/statm: sizes in pages, the whole address space first, then the resident set.
  if (const std::optional<std::string> statm = ReadFile("/proc/self/statm")) {
    std::istringstream in(*statm);
    double virtual_pages = 0, resident_pages = 0;
    if (in >> virtual_pages >> resident_pages) {
      const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
      families.push_back(Family("process_resident_memory_bytes", "Resident memory size in bytes.",
                                MetricType::Gauge, resident_pages * page));
      families.push_back(Family("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                                MetricType::Gauge, virtual_pages * page));
    }
  }
  std::error_code error;
  double open_fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++open_fds;
  }
  if (!error) {
    // As the Go and Python clients count: the listing's own descriptor included.
    families.push_back(Family("process_open_fds", "Number of open file descriptors.",
                              MetricType::Gauge, open_fds));
  }
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    families.push_back(Family("process_max_fds", "Maximum number of open file descriptors.",
                              MetricType::Gauge, static_cast<double>(files.rlim_cur)));
  }
  if (const std::optional<double> start = StartTimeSeconds()) {
    families.push_back(Family("process_start_time_seconds",
                              "Start time of the process since unix epoch in seconds.",
                              MetricType::Gauge, *start));
  }
  return families;
}

}  // namespace attention::server
