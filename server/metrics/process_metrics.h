// The process metrics every Prometheus exporter conventionally serves (the names and meanings of
// the Go and Python clients' process collectors), read from /proc/self at each scrape:
//   process_cpu_seconds_total      user + system CPU time
//   process_resident_memory_bytes  resident set size
//   process_virtual_memory_bytes   virtual address space size
//   process_open_fds               open file descriptors
//   process_max_fds                the soft limit on open file descriptors (RLIMIT_NOFILE)
//   process_start_time_seconds     when the process started, seconds since the Unix epoch
// A value that cannot be read (no /proc) is left out rather than exported as 0.
#pragma once

#include <vector>

#include "prometheus/metric_family.h"

namespace attention::server {

std::vector<prometheus::MetricFamily> CollectProcessMetrics();

}  // namespace attention::server
