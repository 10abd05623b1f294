// attention_server: serves attention.v1.Attention and attention.v1.Sessions over gRPC, with health,
// reflection and Prometheus metrics. Flags are read here only and handed on as option structs.
//
// Shutdown on SIGTERM or SIGINT: health turns NOT_SERVING, new requests are answered UNAVAILABLE,
// requests already accepted finish (for up to --shutdown_grace_s, then they are cancelled), open
// streams end UNAVAILABLE, and the process exits 0. Idle connections do not hold the exit.
//
// --max_connection_age_s makes clients reconnect now and then (gRPC sends GOAWAY; calls in flight
// get --max_connection_age_grace_s), so clients behind a load balancer or a Kubernetes Service
// re-resolve and spread over new replicas.
//
// Security (security.h): --tls_cert/--tls_key serve TLS, --tls_client_ca adds mutual TLS, and
// --auth_token_file requires a bearer token on every Attention and Sessions call; health stays
// open.
//
// KV-resident sessions (session_service.h): --kv_cache_fraction of each device's memory is held
// as pages of --kv_page_bytes from the executor's page pool; idle sessions expire after
// --session_ttl_s; with --kv_host_bytes, cold sessions' pages wait in host memory while the pool is
// full. Health reports attention.v1.Sessions NOT_SERVING when there is no pool.
//
// A device whose CUDA context a fault corrupted is taken out of service
// (attention_device_in_service turns 0); when none is left, health turns NOT_SERVING and calls get
// UNAVAILABLE.
#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "git_commit.h"  // ATTENTION_GIT_COMMIT, written by the build (server/git_commit.cmake)
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/codegen/completion_queue_tag.h"
#include "grpcpp/resource_quota.h"
#include "kernels/status_macros.h"
#include "server/calls/call_gate.h"
#include "server/calls/security.h"
#include "server/executors/executor.h"
#include "server/executors/host_memory.h"
#include "server/executors/region_hooks.h"
#include "server/metrics/metrics.h"
#include "server/options/server_options.h"
#include "server/requests/session_request.h"
#include "server/scheduling/scheduler.h"
#include "server/service/attention_service.h"
#include "server/service/connections.h"
#include "server/service/reflection_v1.h"
#include "server/service/session_service.h"
#include "server/service/shared_memory_service.h"
#include "server/sessions/session_store.h"
#include "server/streams/generic_streams.h"
#include "server/streams/request_rings.h"
#include "server/streams/socket_streams.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on (gRPC and metrics).");
ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one.");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port; 0 picks a free one.");
ABSL_FLAG(std::string, backend, "auto",
          "auto | cpu | cuda. auto: cuda when a GPU is visible, else cpu.");
ABSL_FLAG(int, threads, 0, "CPU backend compute threads; 0 = all cores.");
ABSL_FLAG(int, workers, 0,
          "Scheduler worker threads (batches run at once); 0 = --streams x GPUs for cuda, 2 for "
          "cpu.");
ABSL_FLAG(int, max_message_mb, 1024, "Largest gRPC message received or sent, MiB (1..2047).");
ABSL_FLAG(int64_t, max_chunked_request_mb, 8192,
          "Largest q + k + v (and o + lse) of one AttendChunked request, MiB; its chunks are "
          "messages under --max_message_mb.");
ABSL_FLAG(int64_t, chunked_memory_mb, 16384,
          "Host memory all unfinished AttendChunked calls may hold together, MiB; a call whose "
          "request would pass it is refused RESOURCE_EXHAUSTED before its block is allocated.");
ABSL_FLAG(int, chunked_idle_timeout_s, 60,
          "Seconds an AttendChunked call may wait for its next message; past it the call ends "
          "DEADLINE_EXCEEDED and its memory is freed.");
ABSL_FLAG(int, receive_memory_mb, 0,
          "Memory gRPC may hold for requests being received, all connections together, MiB; "
          "beyond it the stream being filled is cancelled, so a request over the message limit "
          "costs at most this. 0 = --max_message_mb + 64.");
ABSL_FLAG(int, malloc_keep_mb, 64,
          "Free heap memory malloc keeps for reuse rather than returning to the kernel, MiB; "
          "blocks up to min(this, 32) MiB come from the heap. 0 = glibc's defaults.");
ABSL_FLAG(int, max_queue, 256, "Requests that may wait for a device; more are refused.");
ABSL_FLAG(int, max_head_dim, 256,
          "Largest head dim (q, k and v) served, 1..1024: the CUDA kernels take 256 at most, the "
          "CPU backend any (MLA's absorbed decode: QK 576, V 512). Reported in ServerInfo.");
ABSL_FLAG(int, max_batch, 1,
          "Requests per kernel launch at most (dynamic batching; reported in ServerInfo).");
ABSL_FLAG(int, max_queue_delay_us, 0,
          "How long the oldest queued request waits for others to join its batch, microseconds.");
ABSL_FLAG(int, worker_spin_us, -1,
          "How long an idle scheduler worker polls the queue before it sleeps, microseconds: a "
          "request queued meanwhile starts without a thread wake-up (tens of us on a virtual "
          "machine), at the cost of up to one busy core; 0 = sleep at once; -1 = the backend's "
          "default (cuda 1000: a GPU server's cores wait on the GPU anyway; cpu 0: its cores "
          "compute).");
ABSL_FLAG(std::string, devices, "",
          "cuda: comma-separated GPU ordinals to serve on; empty = every visible GPU. cpu: one "
          "device per entry (cpu:N, sharing the cores); empty = one.");
ABSL_FLAG(int, streams, 4, "cuda: CUDA streams per GPU (requests in flight on each).");
ABSL_FLAG(double, device_memory_fraction, 0.65,
          "cuda: share of each GPU's memory the request buffers may hold; larger requests are "
          "refused with RESOURCE_EXHAUSTED. With --kv_cache_fraction at most 1.");
ABSL_FLAG(int, shutdown_grace_s, 30, "Seconds in-flight requests get to finish on shutdown.");
ABSL_FLAG(int, max_connection_age_s, 0,
          "Seconds after which a client connection is asked to reconnect (GOAWAY), so clients "
          "re-resolve and rebalance; 0 = never.");
ABSL_FLAG(int, max_connection_age_grace_s, 0,
          "Seconds calls in flight on an aged connection get before it is closed; 0 = unlimited.");
ABSL_FLAG(int, stream_window, 16,
          "Messages one AttendStream or StepStream may hold at once (running, or answered and "
          "waiting to be written); its next read waits while it holds this many. 1: the next "
          "message is read only once the last answer is written (a pipelining client is then "
          "served one message at a time).");
ABSL_FLAG(bool, poll_streams, false,
          "Serve Attention.AttendStream and Sessions.StepStream on gRPC's async API, every "
          "completion of their calls taken by one thread that polls without sleeping: no thread "
          "wake-up per message, at the cost of one core busy while messages come (it sleeps after "
          "20 ms without one).");
ABSL_FLAG(int, log_calls, 1,
          "The request log on stderr: 0 none; 1 one line per refused or failed call (rpc, peer, "
          "status, time, message); 2 one line per call. At most 20 lines a second, the calls "
          "beyond counted in the next line.");
ABSL_FLAG(std::string, unix_socket, "",
          "When set, gRPC also listens on this Unix domain socket path (clients: unix:PATH): "
          "co-located clients skip TCP's loopback stack. With --allow_shared_memory it needs "
          "--auth_token_file (every client of a socket has the same peer name).");
ABSL_FLAG(std::string, port_file, "",
          "If set, \"<grpc_port> <metrics_port>\\n\" is written here once both ports listen.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for TLS on the gRPC port; empty = plaintext. Needs --tls_key.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token; when set, every attention.v1.Attention and "
          "attention.v1.Sessions call must send "
          "'authorization: Bearer <token>' (health checks stay open).");
ABSL_FLAG(double, kv_cache_fraction, 0.25,
          "Share of each device's memory (host RAM for the cpu backend, committed only as pages "
          "are written) held as KV pages for attention.v1.Sessions; 0 = no sessions.");
ABSL_FLAG(int64_t, kv_cache_bytes, 0,
          "Bytes of each device's memory held as KV pages; when > 0 it replaces "
          "--kv_cache_fraction.");
ABSL_FLAG(int64_t, kv_page_bytes, 524288,
          "Bytes per KV page (a multiple of 256); a page holds rows of one session.");
ABSL_FLAG(int64_t, kv_host_bytes, 0,
          "Bytes of host memory per device (pinned on a GPU) where the pages of cold sessions (no "
          "call holds them; least recently used first) wait while the KV pool is full, coming "
          "back on the session's next call; 0 = none: a full pool refuses new rows.");
ABSL_FLAG(int, session_ttl_s, 600, "Seconds after which an idle session expires.");
ABSL_FLAG(std::string, replica_name, "",
          "This replica's name (1..32 of a-z, 0-9, '-'; empty: none): every session id it makes "
          "starts with it and a '.', and ServerInfo reports it, so a router in front of several "
          "replicas sends a session's calls (their attention-session-owner header) to its owner.");
ABSL_FLAG(bool, allow_shared_memory, false,
          "Serve attention.v1.SharedMemory: co-located clients register POSIX shared-memory "
          "objects and reference tensors in them. Only for trusted clients on this host.");
ABSL_FLAG(int, max_shared_memory_regions, 64, "Shared-memory regions one caller may register.");
ABSL_FLAG(int64_t, max_shared_memory_bytes, int64_t{64} << 30,
          "Bytes of shared memory mapped at most, over every caller.");
ABSL_FLAG(int, region_idle_timeout_s, 300,
          "Without --auth_token_file (a region then belongs to a connection, and goes with it): "
          "seconds after which a shared-memory region no request has used is released too.");
ABSL_FLAG(bool, allow_foreign_regions, false,
          "Register POSIX shared-memory objects owned by another user than the server's (refused "
          "PERMISSION_DENIED otherwise).");
ABSL_FLAG(int, max_rings, 4,
          "With --allow_shared_memory: request rings (SharedMemory.OpenRing) served at once, over "
          "every caller. Each has a thread of its own, which spins while its requests come (it "
          "sleeps after 20 ms without one). 0: no rings.");
ABSL_FLAG(int, stream_wait_timeout_s, 60,
          "cuda: seconds a Step's work waits on the GPU for its caller's ready_counter or "
          "ready_event before the server goes on without it (writes the counter's value itself, "
          "or passes the event), so one caller cannot hold the stream that serves every session "
          "of its GPU (that caller's next Step naming the counter or event is refused: its late "
          "Step's results are undefined). At most 8 waits for events that never completed are "
          "held at once; more ready_event Steps are refused until one completes.");
ABSL_FLAG(int, socket_port, -1,
          "TCP port of the socket streams (attention.v1.Sockets: StepStream's and AttendStream's "
          "messages framed by a length word instead of HTTP/2, for remote clients whose calls are "
          "large and frequent), on --host; 0 picks a free one (ServerInfo.socket_port tells "
          "clients); -1: none. The socket carries its bytes in the clear: not with --tls_cert.");
ABSL_FLAG(int, max_sockets, 16,
          "With --socket_port: socket streams served, or waiting for their connection, at once; "
          "each has a thread of its own.");
ABSL_FLAG(int, socket_stall_timeout_s, 30,
          "Seconds a socket stream's client may read none of an answer's bytes before the socket "
          "ends DEADLINE_EXCEEDED, freeing its thread and its place among --max_sockets.");
ABSL_FLAG(int, ring_stall_timeout_s, 30,
          "Seconds a request ring's answer may wait for a free response slot (its client stopped "
          "taking answers) before the ring ends DEADLINE_EXCEEDED, freeing its region and its "
          "place among --max_rings.");
ABSL_FLAG(double, max_request_flops, 0,
          "Work one request may ask for, FLOPs (4 * Hq * D * visible query-key pairs); more is "
          "refused RESOURCE_EXHAUSTED. 0 = the backend's default (cuda 2e15, cpu 5e13).");

namespace attention::server {
namespace {

constexpr char kServiceName[] = "attention.v1.Attention";
constexpr char kSessionsServiceName[] = "attention.v1.Sessions";

std::string HostPort(const std::string& host, int port) {
  // IPv6 literals need brackets.
  return host.find(':') == std::string::npos ? absl::StrCat(host, ":", port)
                                             : absl::StrCat("[", host, "]:", port);
}

// Writes `contents` to `path` atomically: readers see the whole file or none.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    out << contents;
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", temp));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path));
  }
  return absl::OkStatus();
}

// One KV page pool per executor, kept by the executor: `bytes` (or fraction * memory) /
// page_bytes pages. The store's device d is executor d.
// Empty when both are 0 or the backend keeps no pages (its executor answers UNIMPLEMENTED).
// `request_fraction` is the share of each device's memory its request buffers may hold beside.
absl::StatusOr<std::vector<KvDevice>> MakeKvDevices(
    const KvCacheOptions& o, double request_fraction,
    const std::vector<std::unique_ptr<Executor>>& executors) {
  std::vector<KvDevice> devices;
  if (o.fraction == 0 && o.bytes == 0) return devices;
  for (const auto& executor : executors) {
    const DeviceDescription& device = executor->device();
    ASSIGN_OR_RETURN(int64_t pages,
                     KvCachePages(o, request_fraction, device.name, device.memory_bytes));
    absl::StatusOr<KvPagePool*> pool = executor->InitKvPool(pages, o.page_bytes);
    if (absl::IsUnimplemented(pool.status())) {
      std::fprintf(stderr, "attention_server: no KV sessions: %s\n",
                   pool.status().ToString().c_str());
      return std::vector<KvDevice>{};
    }
    if (!pool.ok()) return pool.status();
    const bool v_head_dim = std::find(device.step_options.begin(), device.step_options.end(),
                                      "v_head_dim") != device.step_options.end();
    KvDevice& kv =
        devices.emplace_back(KvDevice{.name = device.name,
                                      .pool = *pool,
                                      .health = [e = executor.get()] { return e->Health(); },
                                      .v_head_dim = v_head_dim});
    if (o.host_bytes > 0) {
      ASSIGN_OR_RETURN(kv.host_tier, (*pool)->AllocateHost(o.host_bytes));
      kv.host_tier_bytes = o.host_bytes;
    }
  }
  return devices;
}

// The plain options (server/options/server_options.h) and the gRPC edge's.
struct ServerConfig : ServerOptions {
  SecurityOptions security;
  ServiceOptions service;
  // Read from --auth_token_file; empty: no token is required.
  std::string auth_token;
  CallLogOptions call_log;
};

// One executor per device of the chosen backend ("auto" resolved into o->backend).
absl::StatusOr<std::vector<std::unique_ptr<Executor>>> MakeExecutors(ServerOptions* o) {
  const int gpus = CudaDeviceCount();
  if (o->backend == "auto") o->backend = gpus > 0 ? "cuda" : "cpu";
  std::vector<std::unique_ptr<Executor>> executors;
  if (o->backend == "cpu") {
    // One device, or with --devices one per entry (cpu:N), all sharing the host's cores: the
    // placement over several devices, without GPUs.
    for (int ordinal : o->devices) {
      if (ordinal < 0 || std::count(o->devices.begin(), o->devices.end(), ordinal) > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--devices: expected distinct non-negative CPU device numbers, got ", ordinal));
      }
      executors.push_back(MakeCpuExecutor(o->threads, absl::StrCat("cpu:", ordinal)));
    }
    if (executors.empty()) executors.push_back(MakeCpuExecutor(o->threads));
    if (o->scheduler.workers == 0) o->scheduler.workers = 2 * static_cast<int>(executors.size());
    return executors;
  }
  if (gpus == 0) {
    return absl::FailedPreconditionError(
        "--backend=cuda: no CUDA device is visible (or this build has no CUDA); use --backend=cpu");
  }
  std::vector<int> ordinals = o->devices;
  if (ordinals.empty()) {
    for (int i = 0; i < gpus; ++i) ordinals.push_back(i);
  }
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= gpus) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: ", ordinal, " is not a visible GPU (0..", gpus - 1, ")"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Executor> executor, MakeCudaExecutor(ordinal, o->cuda));
    executors.push_back(std::move(executor));
  }
  // Enough workers to keep every stream of every GPU busy.
  if (o->scheduler.workers == 0) {
    o->scheduler.workers = o->cuda.streams * static_cast<int>(executors.size());
  }
  return executors;
}

// The shutdown's steps (Run): how long aborted work gets to answer after the grace, the linger
// for answers in transit, the quiet that ends the holding of refusals and its longest wait, and
// gRPC's own close.
constexpr absl::Duration kAbortWait = absl::Seconds(2);
constexpr absl::Duration kLinger = absl::Seconds(1);
// The quiet outlasts a client's usual pause between calls (its own work between them): a client
// that has sent its next call by then waits on a held answer instead of sending into gRPC's
// shutdown (below). With 50 ms a client pausing 0-150 ms sent into it (CANCELLED once in the 15
// drains of an ASan run of reliability_tests' ShutdownTest).
constexpr absl::Duration kQuiet = absl::Milliseconds(250);
constexpr absl::Duration kMaxHold = absl::Seconds(1);
constexpr absl::Duration kClose = absl::Milliseconds(500);

int Run(ServerConfig options, const sigset_t& stop_signals) {
  absl::StatusOr<std::vector<std::unique_ptr<Executor>>> executors = MakeExecutors(&options);
  if (!executors.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", executors.status().ToString().c_str());
    return 1;
  }
  options.service.backend = options.backend;
  options.service.max_request_flops = options.max_request_flops > 0
                                          ? options.max_request_flops
                                          : DefaultMaxRequestFlops(options.backend);
  if (options.sockets.port >= 0 && !options.security.tls_cert.empty()) {
    std::fprintf(stderr,
                 "attention_server: --socket_port with --tls_cert: socket streams carry their "
                 "bytes in the clear, beside a gRPC port that encrypts; serve one or the other\n");
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.security);
  if (!credentials.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", credentials.status().ToString().c_str());
    return 2;
  }
  if (!options.security.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadAuthToken(options.security.auth_token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "attention_server: %s\n", token.status().ToString().c_str());
      return 2;
    }
    options.auth_token = *std::move(token);
  }
  if (!options.unix_socket.empty() && options.shared_memory.allow && options.auth_token.empty()) {
    // Regions belong to the peer without a token, and every client of a Unix socket has the
    // same peer name ("unix:"): one could use another's regions.
    std::fprintf(
        stderr,
        "attention_server: --unix_socket with --allow_shared_memory needs "
        "--auth_token_file: clients of a Unix socket cannot be told apart by their peer\n");
    return 2;
  }
  Metrics metrics(BuildInfo{.version = options.service.version,
                            .backend = options.backend,
                            .cuda = ATTENTION_CUDA_VERSION});
  for (const auto& executor : *executors) {
    metrics.SetDeviceMemoryTotal(executor->device().name, executor->device().memory_bytes);
  }
  absl::StatusOr<int> metrics_port = metrics.Serve(HostPort(options.host, options.metrics_port));
  if (!metrics_port.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", metrics_port.status().ToString().c_str());
    return 1;
  }

  // Before the scheduler takes the executors.
  absl::StatusOr<std::vector<KvDevice>> kv_devices = MakeKvDevices(
      options.kv_cache, options.backend == "cpu" ? 0 : options.cuda.memory_fraction, *executors);
  if (!kv_devices.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", kv_devices.status().ToString().c_str());
    return 1;
  }
  // Set once the server runs; a device lost before then is seen by the check after the start.
  std::atomic<grpc::HealthCheckServiceInterface*> health_service{nullptr};
  options.scheduler.on_device_lost = [&health_service](const DeviceDescription&,
                                                       const absl::Status&, int in_service) {
    grpc::HealthCheckServiceInterface* health = health_service.load();
    if (in_service > 0 || health == nullptr) return;
    // Nothing left to compute on: load balancers and orchestrators move traffic elsewhere.
    for (const char* service : {"", kServiceName, kSessionsServiceName}) {
      health->SetServingStatus(service, false);
    }
  };
  Scheduler scheduler(*std::move(executors), options.scheduler,
                      [&metrics](int depth) { metrics.SetQueueDepth(depth); });
  // Declared after the scheduler, so it stops sampling the scheduler before the scheduler goes.
  const std::unique_ptr<Metrics::SchedulerWatch> watch = metrics.Watch(scheduler);
  DrainGate drain;
  CallLog call_log(options.call_log);
  // Every call of every service passes this one gate: token, drain, metrics, request log.
  const CallGate gate(&metrics, &drain, options.auth_token, &call_log);
  // Shared-memory regions of co-located clients (--allow_shared_memory); null: off.
  std::unique_ptr<RegionRegistry> regions;
  if (options.shared_memory.allow) {
    regions = std::make_unique<RegionRegistry>(options.shared_memory.limits,
                                               MakeRegionHooks(options.backend), OpenConnections);
  }
  // Where a request's tensors land (their one host copy) and its results are sent from: pinned
  // for the GPUs' DMAs, freed blocks kept up to twice the message limit.
  const std::unique_ptr<HostMemory> host_memory =
      options.backend == "cuda" ? MakePinnedHostMemory(2 * options.service.max_message_bytes)
                                : MakePageableHostMemory();
  std::unique_ptr<SessionStore> session_store;
  if (!kv_devices->empty()) {
    session_store = std::make_unique<SessionStore>(
        *std::move(kv_devices),
        SessionStoreOptions{
            .ttl = absl::Seconds(options.kv_cache.ttl_s),
            .replica_name = options.replica_name,
            .on_expired = [&metrics](int count) { metrics.SessionsExpired(count); },
            .on_usage =
                [&metrics](const std::string& device, const KvCacheUsage& usage) {
                  metrics.SetKvCache(device, usage.sessions, usage.resident_bytes, usage.pages_free,
                                     usage.pages_total, usage.pages_shared, usage.pages_cached);
                  metrics.SetKvHostTier(device, usage.host_bytes_used, usage.host_bytes_total);
                },
            .on_prefix =
                [&metrics](const std::string& device, const PrefixLookup& lookup) {
                  metrics.PrefixLookedUp(device, lookup.hit_blocks, lookup.missed_blocks,
                                         lookup.shared_bytes);
                },
            .on_evicted = [&metrics](const std::string& device,
                                     int64_t pages) { metrics.PrefixPagesEvicted(device, pages); },
            .on_host_tier =
                [&metrics](const std::string& device, const HostTierMove& move) {
                  metrics.KvHostTierMoved(device, move.spilled_pages, move.restored_pages,
                                          move.restore_seconds);
                }});
  }
  // The stream methods every stream transport serves (filled below, once the services exist):
  // gRPC's callback API or the polled async API (--poll_streams), the request rings, the sockets.
  StreamMethods stream_methods;
  // Socket streams (--socket_port), listening before the service is made, which reports their
  // port in ServerInfo; stopped after the server and the scheduler (below).
  std::unique_ptr<SocketStreams> sockets;
  if (options.sockets.port >= 0) {
    sockets = std::make_unique<SocketStreams>(
        &stream_methods, &gate,
        SocketStreamOptions{.max_sockets = options.sockets.max_sockets,
                            .stall_timeout = absl::Seconds(options.sockets.stall_timeout_s),
                            .max_message_bytes = options.service.max_message_bytes});
    absl::StatusOr<int> socket_port = sockets->Listen(options.host, options.sockets.port);
    if (!socket_port.ok()) {
      std::fprintf(stderr, "attention_server: %s\n", socket_port.status().ToString().c_str());
      return 1;
    }
    options.service.socket_port = *socket_port;
  }
  AttentionService service(options.service, &scheduler, &gate, host_memory.get(), regions.get(),
                           session_store.get());
  // CUDA events of packed Steps in stream order, opened once per handle.
  std::unique_ptr<IpcEvents> events;
  if (options.shared_memory.allow) {
    events = std::make_unique<IpcEvents>(MakeEventHooks(options.backend));
  }
  SessionService sessions(
      SessionServiceOptions{
          .max_message_bytes = options.service.max_message_bytes,
          .max_head_dim = options.service.max_head_dim,
          .max_request_flops = options.service.max_request_flops,
          .stream_window = options.service.stream_window,
          .sweep_interval = std::min(absl::Seconds(1), absl::Seconds(options.kv_cache.ttl_s) / 4)},
      session_store.get(), &scheduler, &gate, regions.get(), events.get());
  stream_methods.Add(kAttendStreamPath, service.AttendStreamMethod());
  stream_methods.Add(kStepStreamPath, sessions.StepStreamMethod());
  // Request rings in the callers' regions; stopped after the server and the scheduler (below).
  std::unique_ptr<RequestRings> rings;
  if (regions != nullptr && options.shared_memory.max_rings > 0) {
    rings = std::make_unique<RequestRings>(
        &stream_methods, regions.get(), &gate, options.shared_memory.max_rings,
        absl::Seconds(options.shared_memory.ring_stall_timeout_s));
  }
  SharedMemoryService shared_memory(regions.get(), rings.get(), &gate);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(HostPort(options.host, options.port), *credentials, &port);
  // gRPC sets SO_REUSEPORT by default, so a second server on a port in use would start and
  // silently share it, taking part of its connections. Off: that second server fails to bind.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (!options.unix_socket.empty()) {
    // A socket left by an earlier run would make the bind fail; anything else there is kept (and
    // the bind fails, naming the path).
    struct stat st;
    if (lstat(options.unix_socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      unlink(options.unix_socket.c_str());
    }
    builder.AddListeningPort(absl::StrCat("unix:", options.unix_socket), *credentials);
  }
  const int max_message = static_cast<int>(options.service.max_message_bytes);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  // Memory for what is refused stays bounded. gRPC 1.51 receives a whole message before its
  // size limit refuses it (the HTTP/2 window opens to the size the message announces), so an
  // over-limit request would otherwise cost its full size: the resource quota caps what gRPC
  // holds for messages in reception, all connections together, and beyond it gRPC cancels the
  // stream it is filling. Compressed requests are refused (UNIMPLEMENTED, naming the algorithm)
  // before anything is inflated: gRPC would inflate a message whole before checking its size,
  // and tensors of floats barely compress, so nothing is lost.
  grpc::ResourceQuota quota("attention_server");
  quota.Resize(static_cast<size_t>(options.receive_memory_bytes > 0
                                       ? options.receive_memory_bytes
                                       : options.service.max_message_bytes + (int64_t{64} << 20)));
  builder.SetResourceQuota(quota);
  if (options.max_connection_age_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, options.max_connection_age_s * 1000);
    if (options.max_connection_age_grace_s > 0) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                 options.max_connection_age_grace_s * 1000);
    }
  }
  builder.RegisterService(&service);
  builder.RegisterService(&sessions);
  // AttendStream and StepStream, the methods no service registers (both services mark them
  // generic).
  CallbackStreams callback_streams(&stream_methods);
  grpc::AsyncGenericService async_streams;
  std::unique_ptr<grpc::ServerCompletionQueue> streams_queue;
  if (options.poll_streams) {
    builder.RegisterAsyncGenericService(&async_streams);
    streams_queue = builder.AddCompletionQueue();
  } else {
    builder.RegisterCallbackGenericService(&callback_streams);
  }
  builder.RegisterService(&shared_memory);
  std::vector<std::string> served = {kServiceName,
                                     kSessionsServiceName,
                                     "attention.v1.SharedMemory",
                                     "grpc.health.v1.Health",
                                     "grpc.reflection.v1.ServerReflection",
                                     "grpc.reflection.v1alpha.ServerReflection"};
  if (sockets != nullptr) {
    builder.RegisterService(sockets.get());
    served.push_back("attention.v1.Sockets");
  }
  // Reflection v1 beside gRPC's v1alpha plugin; both list what the server serves.
  ReflectionV1Service reflection_v1(served);
  builder.RegisterService(&reflection_v1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  // Declared after the server: on an early return it stops first, after the server's Shutdown.
  std::unique_ptr<PolledStreams> polled_streams;
  if (streams_queue != nullptr) {
    polled_streams =
        std::make_unique<PolledStreams>(&stream_methods, &async_streams, std::move(streams_queue));
    if (server != nullptr) polled_streams->Start();
  }
  if (server == nullptr || port == 0) {
    std::fprintf(stderr,
                 "attention_server: cannot listen on %s%s%s for gRPC: another process holds the "
                 "port (--port picks another; 0 a free one), or the address is not this host's "
                 "(--host)\n",
                 HostPort(options.host, options.port).c_str(),
                 options.unix_socket.empty() ? "" : " or unix:", options.unix_socket.c_str());
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(kSessionsServiceName, session_store != nullptr);
  health_service.store(health);
  if (scheduler.devices_in_service() == 0) options.scheduler.on_device_lost({}, {}, 0);

  if (!options.port_file.empty()) {
    absl::Status written =
        WriteFileAtomically(options.port_file, absl::StrCat(port, " ", *metrics_port, "\n"));
    if (!written.ok()) {
      std::fprintf(stderr, "attention_server: --port_file: %s\n", written.ToString().c_str());
      server->Shutdown();
      return 1;
    }
  }
  std::fprintf(stderr,
               "attention_server listening on %s%s%s%s (%s%s), metrics on :%d, backend %s\n",
               HostPort(options.host, port).c_str(),
               options.unix_socket.empty() ? "" : " and unix:", options.unix_socket.c_str(),
               sockets == nullptr
                   ? ""
                   : absl::StrCat(", socket streams on :", options.service.socket_port).c_str(),
               options.security.tls_cert.empty()
                   ? "plaintext"
                   : (options.security.tls_client_ca.empty() ? "TLS" : "mutual TLS"),
               options.auth_token.empty() ? "" : ", bearer token required", *metrics_port,
               options.backend.c_str());

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  std::fprintf(stderr, "attention_server: %s, draining (grace %d s)\n", strsignal(signal_number),
               options.shutdown_grace_s);
  health->SetServingStatus("", false);
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus(kSessionsServiceName, false);
  drain.StartDraining();
  // The service drains first, with the server still up: requests arriving meanwhile are answered
  // UNAVAILABLE by the service. (gRPC's own Shutdown cancels calls that arrive after it began, so
  // a client would read CANCELLED, and it waits for idle connections until its deadline.)
  const absl::Time grace_end = absl::Now() + absl::Seconds(options.shutdown_grace_s);
  bool drained = drain.AwaitDrained(grace_end);
  if (!drained) {
    // The grace is over: what still runs is stopped (the CPU kernels at their next tile; a GPU
    // launch, bounded by --max_request_flops, runs out) and answered UNAVAILABLE, as is what waits.
    std::fprintf(stderr, "attention_server: grace period over, stopping the work left\n");
    scheduler.Abort(absl::UnavailableError(
        absl::StrCat("server is shutting down: its grace period of ", options.shutdown_grace_s,
                     " s ended before this call was answered")));
    drained = drain.AwaitDrained(absl::Now() + kAbortWait);
  }
  // Then a linger, still refusing: the answers in transit go out, and a client whose call was
  // among the last answered, and which sends its next one at once, is refused by the service
  // rather than cancelled by gRPC's shutdown.
  if (drained) absl::SleepFor(std::min(kLinger, grace_end - absl::Now()));
  // The streams still open (AttendStream, StepStream, request rings, sockets) end UNAVAILABLE, each
  // once its answers are written, rather than be cancelled by gRPC's shutdown below; a stream
  // opened from here on has its first message refused, held as below.
  stream_methods.EndOpenStreams(absl::UnavailableError("server is shutting down"));
  // Then the refusals are held until calls stop arriving (each client waits for its answer), so
  // none is half-received when gRPC shuts down; gRPC sends its GOAWAY, and only then are the held
  // calls answered UNAVAILABLE: their clients' next calls find the server gone, not cancelled.
  drain.HoldUntilQuiet(kQuiet, kMaxHold);
  // gRPC's shutdown begins here, on this thread: grpc_server_shutdown_and_notify returns once it
  // has stopped listening and queued a GOAWAY on every connection. A call reaching gRPC after
  // this is cancelled by it (gRPC 1.51), so the held answers go out only now: each goes on its
  // connection behind the GOAWAY, which its client has therefore read before the answer, and its
  // next call goes elsewhere. (A thread calling Server::Shutdown while this one slept a fixed
  // moment before answering could be late on a loaded host, letting answered clients call again
  // into the shutdown.)
  // grpc::CompletionQueue::Next calls FinalizeResult on every tag it takes: the tag of the
  // shutdown's notification must be a CompletionQueueTag (any other object there is read as one).
  struct ShutdownDone final : grpc::internal::CompletionQueueTag {
    bool FinalizeResult(void** /*tag*/, bool* /*status*/) override { return true; }
  } shutdown_done;
  grpc::CompletionQueue shutdown_queue;
  grpc_server_shutdown_and_notify(server->c_server(), shutdown_queue.cq(), &shutdown_done);
  drain.ReleaseHeld();
  // gRPC: at the deadline it cancels what is left (open streams, calls still running after the
  // grace, whose queued work the scheduler then drops) and closes connections, idle or not.
  server->Shutdown(absl::ToChronoTime(absl::Now() + kClose));
  shutdown_queue.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (shutdown_queue.Next(&tag, &ok)) {
  }
  scheduler.Shutdown();
  if (polled_streams != nullptr) polled_streams->Stop();  // after every call that could still write
  if (rings != nullptr) rings->Stop();
  if (sockets != nullptr) sockets->Stop();
  call_log.Flush();  // the refusals of the drain left out of the log, counted
  std::fprintf(stderr, "attention_server: stopped\n");
  return 0;
}

// A call's message buffers (a batch-64 decode Step: 768 KiB in, 512 KiB out) are freed when it
// ends. With glibc's defaults each free returns the heap's top to the kernel (madvise, brk), and
// the next call faults every page of its buffers in again: on loopback that doubled a bare gRPC
// echo of those bytes (1.33 ms against 0.55 ms, 2-core development machine, 2026-12-06). Keeping
// up to `keep_mb` free for reuse, and serving blocks up to 32 MiB from the heap rather than
// mmap, leaves the pages mapped. Before any thread starts (mallopt is not meant to race
// allocations). False, with the message printed, on a bad value.
bool KeepFreedMemory(int keep_mb) {
  if (keep_mb < 0) {
    std::fprintf(stderr, "attention_server: --malloc_keep_mb: expected >= 0, got %d\n", keep_mb);
    return false;
  }
  if (keep_mb == 0) return true;
  const int64_t keep = int64_t{keep_mb} << 20;
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min<int64_t>(keep, int64_t{32} << 20)));
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<int64_t>(keep, int64_t{1} << 30)));
  return true;
}

}  // namespace
}  // namespace attention::server

int main(int argc, char** argv) {
  // Block the stop signals before any thread starts, so every thread inherits the mask and only
  // the sigwait in Run receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // Before any CUDA call: each GPU's streams (the pool's, the executor's, the gates that wait for
  // callers' events, the rescue stream) get hardware queues of their own, up to CUDA's 32, rather
  // than the default 8 shared ones: a stream blocked on a caller's late event or counter must not
  // hold a stream that shares its queue. An operator's own setting stands.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);

  // This abseil build checks every absl::Mutex lock against a global lock-order graph (its debug
  // mode, under one process-wide lock); gRPC takes many such locks per call. Off: a hot path's
  // cost, not a check anything here relies on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage("Serves attention.v1.Attention over gRPC.");
  // --help lists this file's flags (abseil's default looks for a file named like the program).
  const auto own_flags = [](absl::string_view file) { return file == __FILE__; };
  // --version: what was built, from the build (server/CMakeLists.txt), not abseil's own guess.
  absl::SetFlagsUsageConfig({.contains_helpshort_flags = own_flags,
                             .contains_help_flags = own_flags,
                             .version_string = [] {
                               return absl::StrCat("attention_server ", ATTENTION_VERSION,
                                                   "\ncommit ", ATTENTION_GIT_COMMIT,
                                                   "\nbuild type ", ATTENTION_BUILD_TYPE, "\nCUDA ",
                                                   ATTENTION_CUDA_VERSION, "\n");
                             }});
  absl::ParseCommandLine(argc, argv);
  if (!attention::server::KeepFreedMemory(absl::GetFlag(FLAGS_malloc_keep_mb))) return 2;

  attention::server::ServerConfig options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  options.max_connection_age_s = absl::GetFlag(FLAGS_max_connection_age_s);
  options.max_connection_age_grace_s = absl::GetFlag(FLAGS_max_connection_age_grace_s);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.unix_socket = absl::GetFlag(FLAGS_unix_socket);
  options.poll_streams = absl::GetFlag(FLAGS_poll_streams);
  options.call_log.level = absl::GetFlag(FLAGS_log_calls);
  options.security.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.security.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.security.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.scheduler.workers = absl::GetFlag(FLAGS_workers);
  options.scheduler.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.scheduler.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.scheduler.max_queue_delay = absl::Microseconds(absl::GetFlag(FLAGS_max_queue_delay_us));
  const int worker_spin_us = absl::GetFlag(FLAGS_worker_spin_us);
  options.scheduler.worker_spin = absl::Microseconds(
      worker_spin_us != -1 ? worker_spin_us : (options.backend == "cuda" ? 1000 : 0));
  options.cuda.streams = absl::GetFlag(FLAGS_streams);
  options.cuda.memory_fraction = absl::GetFlag(FLAGS_device_memory_fraction);
  options.cuda.stream_wait_timeout = absl::Seconds(absl::GetFlag(FLAGS_stream_wait_timeout_s));
  for (absl::string_view ordinal :
       absl::StrSplit(absl::GetFlag(FLAGS_devices), ',', absl::SkipEmpty())) {
    int value = 0;
    if (!absl::SimpleAtoi(ordinal, &value)) {
      std::fprintf(stderr, "attention_server: --devices: expected GPU ordinals, got '%s'\n",
                   std::string(ordinal).c_str());
      return 2;
    }
    options.devices.push_back(value);
  }
  options.kv_cache.fraction = absl::GetFlag(FLAGS_kv_cache_fraction);
  options.kv_cache.bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.kv_cache.page_bytes = absl::GetFlag(FLAGS_kv_page_bytes);
  options.kv_cache.ttl_s = absl::GetFlag(FLAGS_session_ttl_s);
  options.kv_cache.host_bytes = absl::GetFlag(FLAGS_kv_host_bytes);
  options.replica_name = absl::GetFlag(FLAGS_replica_name);
  options.service.replica_name = options.replica_name;
  options.max_request_flops = absl::GetFlag(FLAGS_max_request_flops);
  options.max_head_dim = absl::GetFlag(FLAGS_max_head_dim);
  options.service.max_head_dim = options.max_head_dim;
  options.shared_memory.allow = absl::GetFlag(FLAGS_allow_shared_memory);
  options.shared_memory.limits.max_regions_per_owner =
      absl::GetFlag(FLAGS_max_shared_memory_regions);
  options.shared_memory.limits.max_mapped_bytes = absl::GetFlag(FLAGS_max_shared_memory_bytes);
  options.shared_memory.limits.idle_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_region_idle_timeout_s));
  options.shared_memory.limits.allow_foreign = absl::GetFlag(FLAGS_allow_foreign_regions);
  options.shared_memory.max_rings = absl::GetFlag(FLAGS_max_rings);
  options.shared_memory.ring_stall_timeout_s = absl::GetFlag(FLAGS_ring_stall_timeout_s);
  options.sockets.port = absl::GetFlag(FLAGS_socket_port);
  options.sockets.max_sockets = absl::GetFlag(FLAGS_max_sockets);
  options.sockets.stall_timeout_s = absl::GetFlag(FLAGS_socket_stall_timeout_s);
  options.receive_memory_bytes = int64_t{absl::GetFlag(FLAGS_receive_memory_mb)} << 20;
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.service.version = ATTENTION_VERSION;
  options.service.max_message_bytes = int64_t{max_message_mb} << 20;
  options.service.max_chunked_request_bytes = absl::GetFlag(FLAGS_max_chunked_request_mb) << 20;
  options.service.chunked_memory_bytes = absl::GetFlag(FLAGS_chunked_memory_mb) << 20;
  options.service.chunked_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_chunked_idle_timeout_s));
  options.service.max_queue = options.scheduler.max_queue;
  options.service.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.stream_window = absl::GetFlag(FLAGS_stream_window);
  options.service.stream_window = options.stream_window;

  absl::Status valid = attention::server::CheckOptions(options, max_message_mb);
  if (valid.ok()) valid = attention::server::CheckKvCacheOptions(options.kv_cache);
  if (valid.ok() && (options.call_log.level < 0 || options.call_log.level > 2)) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("--log_calls: expected 0, 1 or 2, got ", options.call_log.level));
  }
  if (valid.ok() && (options.service.chunked_memory_bytes < 1 ||
                     options.service.chunked_idle_timeout < absl::Seconds(1))) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("--chunked_memory_mb and --chunked_idle_timeout_s: expected >= 1, got ",
                     options.service.chunked_memory_bytes >> 20, " and ",
                     absl::ToInt64Seconds(options.service.chunked_idle_timeout)));
  }
  if (valid.ok() && options.cuda.stream_wait_timeout < absl::Seconds(1)) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("--stream_wait_timeout_s: expected >= 1, got ",
                     absl::ToInt64Seconds(options.cuda.stream_wait_timeout)));
  }
  if (valid.ok() && !options.replica_name.empty() &&
      !attention::server::IsReplicaName(options.replica_name)) {
    valid = absl::InvalidArgumentError(
        absl::StrCat("--replica_name: expected 1..32 characters of a-z, 0-9 and '-', got \"",
                     options.replica_name, "\""));
  }
  if (!valid.ok()) {
    std::fprintf(stderr, "attention_server: %s\n", valid.ToString().c_str());
    return 2;
  }
  return attention::server::Run(std::move(options), stop_signals);
}
