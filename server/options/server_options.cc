#include "server/options/server_options.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace attention::server {

absl::Status CheckOptions(const ServerOptions& o, int max_message_mb) {
  if (o.backend != "auto" && o.backend != "cpu" && o.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend: expected auto, cpu or cuda, got ", o.backend));
  }
  if (max_message_mb < 1 || max_message_mb > 2047) {  // gRPC limits are int bytes
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb: expected 1..2047, got ", max_message_mb));
  }
  if (o.receive_memory_bytes != 0 && o.receive_memory_bytes < (int64_t{max_message_mb} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--receive_memory_mb: expected 0 or at least --max_message_mb (",
                     max_message_mb, "), got ", o.receive_memory_bytes >> 20));
  }
  for (const auto& [name, value] : {std::pair{"--max_queue", o.scheduler.max_queue},
                                    {"--max_batch", o.scheduler.max_batch},
                                    {"--streams", o.cuda.streams},
                                    {"--stream_window", o.stream_window}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 1, got ", value));
    }
  }
  if (o.max_head_dim < 1 || o.max_head_dim > kMaxHeadDimLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_head_dim: expected 1..", kMaxHeadDimLimit, ", got ", o.max_head_dim));
  }
  // A TCP port is 16 bits: gRPC would bind a larger number modulo 65536, somewhere unasked.
  for (const auto& [name, value] :
       {std::pair{"--port", o.port}, {"--metrics_port", o.metrics_port}}) {
    if (value < 0 || value > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected a TCP port 0..65535 (0 picks a free one), got ", value));
    }
  }
  if (o.port != 0 && o.port == o.metrics_port) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--port and --metrics_port: expected two different ports, got ", o.port, " for both"));
  }
  if (o.threads < 0 || o.shutdown_grace_s < 0 || o.scheduler.workers < 0 ||
      o.scheduler.max_queue_delay < absl::ZeroDuration() ||
      o.scheduler.worker_spin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--threads, --workers, --max_queue_delay_us, --worker_spin_us and --shutdown_grace_s must "
        "be >= 0 (--worker_spin_us may be -1: the backend's default)");
  }
  if (o.shared_memory.limits.max_regions_per_owner < 1 ||
      o.shared_memory.limits.max_mapped_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_shared_memory_regions and --max_shared_memory_bytes: expected >= 1, got ",
        o.shared_memory.limits.max_regions_per_owner, " and ",
        o.shared_memory.limits.max_mapped_bytes));
  }
  if (o.shared_memory.max_rings < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_rings: expected >= 0 (0: no request rings), got ", o.shared_memory.max_rings));
  }
  if (o.shared_memory.limits.idle_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--region_idle_timeout_s: expected >= 1, got ",
                     absl::ToInt64Seconds(o.shared_memory.limits.idle_timeout)));
  }
  if (o.shared_memory.ring_stall_timeout_s < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ring_stall_timeout_s: expected >= 1, got ",
                                                   o.shared_memory.ring_stall_timeout_s));
  }
  if (o.sockets.port < -1 || o.sockets.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket_port: expected -1 (none), 0 (a free one) or a port to 65535, got ",
                     o.sockets.port));
  }
  if (o.sockets.max_sockets < 1 || o.sockets.stall_timeout_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_sockets and --socket_stall_timeout_s: expected >= 1, got ",
                     o.sockets.max_sockets, " and ", o.sockets.stall_timeout_s));
  }
  if (!(o.max_request_flops >= 0 && std::isfinite(o.max_request_flops))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_request_flops: expected a finite value >= 0 (0 = the backend's default), got ",
        o.max_request_flops));
  }
  // gRPC takes milliseconds as an int.
  constexpr int kMaxAgeSeconds = std::numeric_limits<int>::max() / 1000;
  for (const auto& [name, value] :
       {std::pair{"--max_connection_age_s", o.max_connection_age_s},
        {"--max_connection_age_grace_s", o.max_connection_age_grace_s}}) {
    if (value < 0 || value > kMaxAgeSeconds) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected 0..", kMaxAgeSeconds, ", got ", value));
    }
  }
  if (!(o.cuda.memory_fraction > 0 && o.cuda.memory_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device_memory_fraction: expected a value in (0, 1], got ", o.cuda.memory_fraction));
  }
  // On a GPU both are carved out of the same memory (the CPU backend ignores the first).
  if (o.backend != "cpu" && o.kv_cache.bytes == 0 &&
      o.cuda.memory_fraction + o.kv_cache.fraction > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device_memory_fraction ", o.cuda.memory_fraction, " + --kv_cache_fraction ",
                     o.kv_cache.fraction, ": expected a sum of at most 1"));
  }
  return absl::OkStatus();
}

absl::Status CheckKvCacheOptions(const KvCacheOptions& o) {
  if (!(o.fraction >= 0 && o.fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_fraction: expected a value in [0, 1), got ", o.fraction));
  }
  if (o.bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_bytes: expected >= 0, got ", o.bytes));
  }
  if (o.page_bytes < 256 || o.page_bytes % 256 != 0 || o.page_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_page_bytes: expected a multiple of 256 from 256 to 2^30, got ", o.page_bytes));
  }
  if (o.host_bytes != 0 && o.host_bytes < o.page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_host_bytes: expected 0 (no host tier) or at least one page of --kv_page_bytes ",
        o.page_bytes, ", got ", o.host_bytes));
  }
  if (o.ttl_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session_ttl_s: expected >= 1, got ", o.ttl_s));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvCachePages(const KvCacheOptions& o, double request_fraction,
                                     const std::string& device_name, int64_t device_memory_bytes) {
  if (o.fraction == 0 && o.bytes == 0) return 0;
  const std::string asked = o.bytes > 0
                                ? absl::StrCat("--kv_cache_bytes ", o.bytes)
                                : absl::StrCat("--kv_cache_fraction ", o.fraction, " of ",
                                               device_name, "'s ", device_memory_bytes, " bytes");
  const double room = (1 - request_fraction) * static_cast<double>(device_memory_bytes);
  if (static_cast<double>(o.bytes) > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        asked, ": more than the ", static_cast<int64_t>(room), " bytes of ", device_name,
        " left beside the request buffers (--device_memory_fraction ", request_fraction, ")"));
  }
  const double cache_bytes = o.bytes > 0 ? static_cast<double>(o.bytes)
                                         : o.fraction * static_cast<double>(device_memory_bytes);
  const int64_t pages = static_cast<int64_t>(cache_bytes / static_cast<double>(o.page_bytes));
  if (pages < 1 || pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(asked, " gives ", pages, " pages of --kv_page_bytes ", o.page_bytes,
                     "; expected 1 to 2^31-1 (or 0 for no sessions)"));
  }
  return pages;
}

double DefaultMaxRequestFlops(const std::string& backend) {
  constexpr double kCudaFlops = 2e15;
  constexpr double kCpuFlops = 5e13;
  return backend == "cuda" ? kCudaFlops : kCpuFlops;
}

}  // namespace attention::server
