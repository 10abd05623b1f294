// The server's options as plain data, and their checks: what main.cc fills from flags and hands
// on to the rooms. No gRPC here (the gRPC edge's own options, ServiceOptions and SecurityOptions,
// stay in service/ and are added to these in main.cc). Every error is INVALID_ARGUMENT and names
// the flag, what was expected and what came.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/executors/executor.h"
#include "server/regions/region_registry.h"
#include "server/scheduling/scheduler.h"

namespace attention::server {

// The KV-resident sessions' cache (sessions/session_store.h).
struct KvCacheOptions {
  double fraction = 0.25;  // of each device's memory; 0: no sessions
  int64_t bytes = 0;       // > 0: this many bytes of each device's memory instead of `fraction`
  int64_t page_bytes = 524288;
  int ttl_s = 600;
  // Bytes of host memory per device (pinned on a GPU) where cold sessions' pages wait while the
  // pool is full (the store's host tier); 0: none, a full pool refuses.
  int64_t host_bytes = 0;
};

// Shared memory for co-located clients (regions/region_registry.h).
struct SharedMemoryOptions {
  bool allow = false;  // --allow_shared_memory
  // --max_shared_memory_regions, --max_shared_memory_bytes, --region_idle_timeout_s,
  // --allow_foreign_regions
  RegionLimits limits;
  int max_rings = 4;  // --max_rings: request rings served at once (streams/request_rings.h)
  // --ring_stall_timeout_s: how long a ring's answer may wait for a free response slot (its
  // client stopped reading) before the ring ends.
  int ring_stall_timeout_s = 30;
};

// --max_head_dim at most: a bound of sanity (today's largest head dim, MLA's absorbed QK, is 576).
inline constexpr int kMaxHeadDimLimit = 1024;

// Socket streams (streams/socket_streams.h): a stream method's messages over plain TCP.
struct SocketOptions {
  int port = -1;             // --socket_port: -1 none, 0 a free one
  int max_sockets = 16;      // --max_sockets: served or waiting for their connection at once
  int stall_timeout_s = 30;  // --socket_stall_timeout_s: no byte of an answer read this long
};

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;
  int metrics_port = 9464;
  std::string backend = "auto";
  int threads = 0;
  std::vector<int> devices;  // empty: every visible GPU
  CudaExecutorOptions cuda;
  int shutdown_grace_s = 30;
  int max_connection_age_s = 0;        // 0: never
  int max_connection_age_grace_s = 0;  // 0: unlimited
  std::string port_file;
  std::string unix_socket;  // also listen on this Unix domain socket path; empty: TCP only
  // AttendStream and StepStream on gRPC's async API, their completions polled by one thread that
  // never sleeps (generic_streams.h); false: on the callback API.
  bool poll_streams = false;
  // Messages one AttendStream or StepStream may hold at once; 1: the next read only once the
  // last answer is written (stream_reactor.h).
  int stream_window = 16;
  // Head dims (q and k's D, v's Dv) served up to this: the CUDA kernels take 256 at most, the CPU
  // backend any (MLA's absorbed decode: QK 576, V 512). Reported in ServerLimits.
  int max_head_dim = 256;
  SchedulerOptions scheduler;
  KvCacheOptions kv_cache;
  // --replica_name: the prefix of the session ids this replica makes (empty: none).
  std::string replica_name;
  SharedMemoryOptions shared_memory;
  SocketOptions sockets;
  // Work one request may ask for (--max_request_flops); 0: the backend's default
  // (DefaultMaxRequestFlops).
  double max_request_flops = 0;
  // Bytes gRPC may hold for requests it is still receiving, every connection together
  // (--receive_memory_mb, its resource quota); 0: the message limit plus 64 MiB.
  int64_t receive_memory_bytes = 0;
};

// The per-request work limit when --max_request_flops is 0, for a resolved backend ("cpu" or
// "cuda"): what the device computes in a few seconds, so that no single call holds it for long
// (CUDA: 2e15, about 6 s of the H200's forward kernel at 330 TFLOP/s; CPU: 5e13, a few minutes
// on a few cores, which a deadline or cancellation can still stop between tiles).
double DefaultMaxRequestFlops(const std::string& backend);

// The checks of everything but the KV cache (CheckKvCacheOptions). `max_message_mb` is the flag
// as given (the service takes it in bytes).
absl::Status CheckOptions(const ServerOptions& o, int max_message_mb);

absl::Status CheckKvCacheOptions(const KvCacheOptions& o);

// KV pages for one device of `device_memory_bytes` named `device_name`: o.bytes (when > 0) or
// o.fraction of the memory, over o.page_bytes; 0 when both are 0 (no sessions). On a GPU the
// request buffers hold `request_fraction` of the memory (--device_memory_fraction; 0 on the CPU),
// and o.bytes must fit in the rest. An error when that does not hold, or when the count is not
// 1 to 2^31-1 (page ids are int32).
absl::StatusOr<int64_t> KvCachePages(const KvCacheOptions& o, double request_fraction,
                                     const std::string& device_name, int64_t device_memory_bytes);

}  // namespace attention::server
