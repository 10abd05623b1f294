// Reading the server's Prometheus endpoint in tests: a minimal HTTP/1.0 GET over a socket, a
// parser for the text exposition format, one metric read or waited for.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attention::e2e {

// The body of GET `path` from 127.0.0.1:`port`; an error unless the status is 200.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

struct MetricSample {
  std::string name;  // e.g. "attention_request_duration_seconds_bucket"
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Every sample line of a text exposition (comments and blank lines skipped).
std::vector<MetricSample> ParseMetrics(const std::string& text);

// Sum of the samples named `name` whose labels include all of `labels`; 0 when there are none.
double SumSamples(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& labels = {});

// Whether any sample is named `name` and has all of `labels`.
bool HasSample(const std::vector<MetricSample>& samples, const std::string& name,
               const std::map<std::string, std::string>& labels = {});

// The sum of `name`'s samples with `labels` on the server's /metrics.
absl::StatusOr<double> ScrapeMetric(int metrics_port, const std::string& name,
                                    const std::map<std::string, std::string>& labels = {});

// Polls `name` (with `labels`) on /metrics until `done` holds for it or 30 s pass; returns the
// last value read (-1 when no scrape succeeded).
double WaitForMetric(int metrics_port, const std::string& name,
                     const std::map<std::string, std::string>& labels,
                     const std::function<bool(double)>& done);

}  // namespace attention::e2e
